"""The SSD tier under the host pages (``local.ssd``): slot format, the scheduler's slot
index, a rank's slot file and the spill / promote jobs. See docs/store.md "SSD tier"."""
