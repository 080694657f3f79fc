"""The scheduler's store bookkeeping (no vLLM): request lookups and pins, whole-prefix
and layerwise save jobs, preempted requests, waits for the tiers behind the host pages.
The rules live here, apart from the connector, so unit tests drive them directly."""
