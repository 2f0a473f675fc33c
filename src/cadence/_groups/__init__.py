"""The process-group layer behind `cadence.comm` and `cadence.topology` (private).

``dist_init`` starts the job's process group from torchrun's environment, ``dp_layout``
says what a wrapper's ``group=`` means, ``exchange`` runs the point-to-point
collectives on gloo, and ``event_log`` records every collective on one clock. The
public faces of this room are `cadence.comm` (every collective) and
`cadence.topology` (degrees to groups). Nothing is imported here, so that importing
one module of the room loads only what it needs.
"""
