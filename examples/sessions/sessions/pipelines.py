"""The project's pipeline. Locations left unset live under `.sparkpoint/visits/` (input,
checkpoints, local state) in the directory it runs in; set them to any fsspec URL.

    python -m sessions.land --batches 6
    sparkpoint run --pipeline sessions.pipelines:visits
"""

from __future__ import annotations

from sessions.operators import first_clicks, sessions
from sparkpoint import Pipeline

# The watermark trails the latest click seen by 2 minutes: a click older than that when its batch
# starts is late, dropped and counted (`late_rows`). Sessions close and seen ids expire on it.
visits = Pipeline("visits", [sessions, first_clicks], event_time="clicked_at", allowed_lateness=120,
                  output_url=".sparkpoint/visits/output", num_retained=2)
