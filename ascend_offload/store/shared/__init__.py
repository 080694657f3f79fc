"""The connector's shared tier behind its local pages (``backend: mooncake`` /
``memcache``): the store-agnostic tier (``tier``), one client module per vendor
(``mooncake``, ``memcache``), the scheduler's fetches, the backend choice and
deadline-bounded calls. See docs/store.md "Shared tier in the connector"."""
