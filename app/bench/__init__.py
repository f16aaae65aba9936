"""The benchmark commands: every number KV Scope prints about speed comes from here, never from a test.

`prompts` (the shared bench text), `throughput` (`kvscope bench`: tokens/s, step time, long context,
snapshot cost), `quality` (`kvscope bench --quality`: what a lossy KV format costs in logits), `ui_frames`
(`kvscope bench --ui`: the window's frame time), `sweep` / `sweep_report` (`kvscope sweep`: knobs swept over
a workload, a report), `attach_soak` / `attach_flood` (the attach window and ingest under load).
Imports engine and ui; nothing but app's command line imports it.
"""
