"""The block map: every slot of every tier as one cell of one uint8 code image, drawn through a 256-entry LUT.

`grid` (where each tier's slots sit, and which slot is at a point), `codes` (a snapshot -> the code image, numpy
passes in place), `code_image` (the image item, drawn as RGB32), `legend` (the colour mode's legend line), `widget`
(`BlockMap`: view, labels, hover, click), `bench` (fake snapshots and the frame-time bench). The attach window's map
(ui/attach/block_map.py) shares the grid, the image item and the legend.
"""
