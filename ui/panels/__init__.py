"""The inspector window's docks, each reading snapshots (numpy arrays, frozen dataclasses) and nothing else.

`charts` (hit rates, memory, heat, residency), `lists` (the sequences table and the event feed), `controls`
(a slider or combo per knob, sent to the engine as a change request), `cost` and `kv_cost` (what the present
config and KV format cost), `prompt` (type a prompt, read the reply).
"""
