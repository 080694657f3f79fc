"""A worker rank's host pages: the whole-prefix page pool mirroring its paged KV cache,
and the layerwise store whose placement the scheduler decides. Workers stay
request-agnostic; the scheduler's index says which page holds what."""
