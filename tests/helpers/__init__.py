"""The tests' shared helpers, one package (issue 34); pytest puts tests/ on sys.path, so a test imports
them as ``from helpers.<name> import ...``, and a worker started by path puts tests/ there itself.

- asuser: run a function as another, unprivileged user (caches shared between users).
- cachedata: a synthetic packed dataset for cache tests and benchmarks, and a subprocess's environment.
- chat_worker: one torchrun rank over packed chat data (tests/pack/test_pack_chat.py).
- cold_cache_worker: one torchrun rank reading through a node cache that starts empty.
- data_gen: small test-data builders: token JSONL/Parquet, image-like file trees, tar shards.
- ddp_metrics_worker: one torchrun rank whose loader logs metrics and a cross-rank summary.
- ddp_worker: one torchrun rank reading a packed dataset (tests/e2e/test_ddp.py).
- exact_eval_worker: one torchrun rank evaluating exactly, a metric reduced across ranks.
- faultfs: the ``faulty://`` fsspec filesystem that injects faults at the storage edge.
- forkranks: fork a gloo job's ranks from one process and time each rank's exit (the workers' launcher).
- fsutil: files on disk: damage one, list leftover temps, mount a small real tmpfs.
- keep_pins: print pip constraints that keep what the environment's other packages pin exactly (tests/run.sh).
- leaks: what a process holds that a closed loader must give back (children, /dev/shm, descriptors).
- megatron_worker: one rank of a Megatron-core run under torchrun (gloo, CPU).
- mesh_worker: one gloo rank reading over a device mesh's data layout (tests/e2e/test_mesh_ddp.py).
- mixplans: the mixture tests' planners over in-memory sources and what each DP rank is served.
- mixture_worker: one torchrun rank reading a mixture (tests/e2e/test_mixture_ddp.py).
- node_share_worker: one torchrun rank reading a remote dataset through the counting S3 proxy.
- peers: the peers' own writers and readers (Streaming, LitData), run in their own venv.
- peers_tool: the script peers runs in the peers' venv to write and read their datasets.
- prolog: run examples/slurm/prolog.sh as SLURM would (no PATH, a minimal environment).
- realdata: real images on this machine (the Adwaita icons as an ImageFolder tree).
- realtext: real text on this machine (the stdlib's source files, /usr/share/doc's text files).
- runcli: run this checkout's ``shardtool`` command in a subprocess, as a user would.
- s3proxy: a real HTTP proxy in front of the moto S3 server that counts requests and injects throttling.
- s3server: a real S3 API server (moto) on 127.0.0.1 in a subprocess, and its fixture.
- schedule_worker: one torchrun rank with a batch-size ramp (tests/loader/test_batch_schedule.py).
- skip_worker: one torchrun rank that skips steps after a roll-back (tests/loader/test_loader_skip_steps.py).
- skips: the one way a test skips because of where it runs, ``require(ok, why)`` (fails under CI's strict mode).
- stage_worker: one rank of a gloo job staging in the job (tests/e2e/test_stage_ddp.py, benchmarks/staging.py).
- strategies: hypothesis strategies shared by the planning and state tests.
- tests_length_fn: the ``--length-fn`` targets of the pack tests (``helpers.tests_length_fn:double_tokens``).
- titan_worker: one rank of a torchtitan-style run, saved and restored by torchtitan's checkpointing.
- torchrun: run a worker script of this package under torchrun: N ranks, gloo, a free port.
- webtars: WebDataset tars as other tools write them (GNU and PAX headers), for index and pack tests.
"""
