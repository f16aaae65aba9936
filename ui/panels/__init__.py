"""The inspector window's docks, each reading snapshots (numpy arrays, frozen dataclasses) and nothing else.

`charts` (hit rates, memory, heat, residency), `lists` (the sequences table and the event feed), `controls`
(the Controls panel: every knob, sent to the engine as a change request, presets and the engine's buttons) with
`knob` (one knob's slider or combo and its value box), `cost` and `kv_cost` (what the present config and KV format
cost), `prompt` (type a prompt, read the reply).
"""
