"""Running requests: the engine thread's step loop and what it drives.

Layers, lowest first: `clock` (engine time); `self_check` (each accelerated path checked against its reference at
first use, and the verdicts); `cuda_graphs` (decode steps captured and replayed);
`model_runner` (a scheduled batch -> tensors -> logits -> tokens); `scheduler` (admission against both
tiers, which sequences run this step, context shifts); `seq_ops` (llama.cpp's seq_rm / seq_cp / seq_keep /
seq_div / K-shift); `engine` (`Engine`: config changes between steps, the step, snapshots). Imports
engine.kv, engine.model, engine.attention, engine.fidelity and engine.telemetry; nothing imports it but
engine.workloads, engine.lab, ui (snapshots only) and app.
"""
