"""What the engine publishes: counters, immutable snapshots, and snapshot files.

Layers, lowest first: `counters` (the running totals); `snapshot` (the frozen records a UI reads: numpy
arrays and small dataclasses, no torch); `snapshotter` (`Telemetry`: builds them and the event feed from an
engine it is handed); `snapshot_fields` / `snapshot_schema` (validating a snapshot read from disk);
`snapshot_io` (save / load .npz). Imports nothing of engine.kv, engine.model or engine.runtime, so ui can read
snapshots without torch.
"""
