"""What the loader observes about itself (docs/architecture.md §4): counters, metric lines, stats, the watchdog.

Files, each importing only those above it in this list (and the loader's own `errors`, `shmring`):

- `probe`      — the shared counter table every reading process writes (`Table`, `Probe`)
- `metrics`    — the trainer-side counters and what ``ShardedLoader.metrics()`` returns (`Meter`)
- `metricslog` — node-local metric lines, run ids, the cross-rank summary
- `watchdog`   — a stuck read becomes an error naming the rank, batch, shard and offset
- `observe`    — `Observer`: all of the above behind the loader's two hooks
- `stats`      — ``shardtool stats``: metric files in, dicts out (pure, no torch)

Nothing is imported here: a reader imports `probe` alone, and stays light.
"""
