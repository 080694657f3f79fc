"""Store services run as loopback child processes (``mooncake_master``, the Memcache
meta service) for tests, benches and one-host deployments; the connector never
starts them."""
