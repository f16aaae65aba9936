"""The health of one publisher's stream, as the window and the JSON summary show it (`SourceStatus`), and the
bounds the subscriber keeps it in (`StreamLimits`: how long a replay request may take, how far behind the live
stream a source may fall before its oldest frames are shed). engine/attach/subscriber.py fills them in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamLimits:
    replay_timeout_s: float = 2.0  # a replay reply must come this soon after the request or the previous one
    replay_deadline_s: float = 10.0  # one replay request at most, waiting for all its replies together
    replay_max_batches: int = 20_000  # batches asked for per request (the newest of a longer gap)
    replay_backoff_s: float = 30.0  # after a replay socket failed to answer, gaps are counted lost this long
    max_queued_frames: int = 200_000  # live frames read but not applied yet, before the oldest are shed
    max_queued_bytes: int = 256 << 20
    max_behind_s: float = 60.0  # the oldest queued frame's age, before the oldest are shed
    behind_note_s: float = 2.0  # a note when the oldest queued frame is this old (again every 10 s), and on catching up
    read_budget_s: float = 0.02  # per turn of the loop: reading the live socket ...
    apply_budget_s: float = 0.02  # ... then applying queued frames


@dataclass(frozen=True)
class SourceStatus:
    label: str
    endpoint: str
    replay: str | None
    frames: int  # multipart messages received live
    malformed: int  # frames skipped: wrong frame count, a bad sequence number, not a batch (or too big)
    batches: int  # batches applied (live + replayed)
    duplicates: int
    gaps: int  # jumps in the sequence
    recovered: int  # batches of gaps recovered from the replay socket
    lost: int  # batches of gaps the replay socket could not give (or that were shed): their events are missing
    history: int  # batches before the first live one, got from the replay socket
    history_missing: int  # batches before the first live one that the replay buffer no longer held
    first_seq: int | None
    last_seq: int | None
    restarts: int
    last_frame_age_s: float | None  # seconds since the last live frame
    lost_ranges: tuple[tuple[int, int], ...]  # the latest few [first, last] seqs lost
    queued: int = 0  # live frames received and not applied yet
    queued_bytes: int = 0
    behind_s: float = 0.0  # how long the oldest of them has waited (0: keeping up)
    shed: int = 0  # live frames dropped unread because the source was too far behind (counted in lost too)
    shed_age_s: float | None = None  # seconds since frames were last shed (None: never)
    replay_state: str = "idle"  # none | idle | waiting | backoff (not answering: gaps counted lost meanwhile)
    replay_timeouts: int = 0  # replay requests given up on (no answer in time, or too slow)
