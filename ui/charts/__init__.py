"""Time-series charts for panels that redraw several times a second.

`scale` (round axis tops and steps), `mark_labels` (where a chart's mark labels go), `strip_chart`
(`StripChart`, QPainter with a cached frame), `rates` (windowed rates measured from snapshots' counters, and a saved
window's lines as it drew them).
"""
