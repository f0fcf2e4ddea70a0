"""A job's staging request (its SLURM comment) and the prolog's pure decisions: parsing, which
versions a budget may evict first, which findings fail the job and which exit drains a node."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.cache.errors import EXIT_LOCAL, EXIT_OK
from shardtool.cache.evict import Entry, eviction_order, plan_eviction
from shardtool.cache.jobs import finding_severity, live_versions, prolog_exit_code, stale_jobs
from shardtool.cache.request import RequestError, StageRequest, comment_from_scontrol, parse_request

STATUSES = ["ok", "partial", "cached", "remote_failed", "usage_error", "local_fault"]


# ------------------------------------------------------------------ parsing
def test_nothing_asked():
    for comment in (None, "", "nightly eval run", "shardtools:/x", "see shardtool:docs"[:0]):
        assert parse_request(comment) is None


def test_a_url_alone_and_relative_paths_are_the_jobs():
    assert parse_request("shardtool:s3://b/ds") == StageRequest("s3://b/ds")
    assert parse_request("shardtool:/lustre/ds other words") == StageRequest("/lustre/ds")
    assert parse_request("run 3 shardtool:data/mix.json", workdir="/home/me/exp").url == "/home/me/exp/data/mix.json"
    assert parse_request("shardtool:../ds", workdir="/home/me/exp").url == "/home/me/ds"


def test_json_request_with_layout():
    r = parse_request(
        'eval shardtool:{"url": "s3://b/ds", "mesh": "pp=2,dp=2", "dp_dim": ["rep", "shard"], '
        '"ranks_per_node": 8, "best_effort": true} after'
    )
    assert r == StageRequest("s3://b/ds", mesh="pp=2,dp=2", dp_dim="rep,shard", ranks_per_node=8, best_effort=True)
    assert r.model_parallel
    r = parse_request('shardtool:{"url": "ds", "dp_size": 4}', workdir="/w")
    assert r == StageRequest("/w/ds", dp_size=4) and r.model_parallel
    assert not parse_request('shardtool:{"url": "ds"}').model_parallel
    assert not parse_request('shardtool:{"url": "ds"}').data_layout_given
    together = parse_request('shardtool:{"url": "ds", "nodes_per_group": 4}')
    assert together.nodes_per_group == 4 and together.data_layout_given and not together.model_parallel
    assert parse_request('shardtool:{"url": "ds", "max_bytes": "1.5G"}').max_bytes == 1_500_000_000
    assert parse_request('shardtool:{"url": "ds", "max_bytes": 4096}').max_bytes == 4096


@pytest.mark.parametrize(
    "comment, message",
    [
        ("shardtool:", "must be followed by"),
        ("shardtool: /x", "must be followed by"),
        ('shardtool:{"url": "x"', "not valid JSON"),
        ('shardtool:["x"]', "must be a JSON object"),
        ('shardtool:{"path": "x"}', "unknown request key(s) 'path'"),
        ('shardtool:{"mesh": "dp=2"}', 'needs "url"'),
        ('shardtool:{"url": "x", "dp_size": 0}', "'dp_size' must be an integer >= 1"),
        ('shardtool:{"url": "x", "ranks_per_node": "8"}', "'ranks_per_node' must be an integer"),
        ('shardtool:{"url": "x", "nodes_per_group": 0}', "'nodes_per_group' must be an integer >= 1"),
        ('shardtool:{"url": "x", "mesh": "dp=2", "dp_size": 2}', "either 'mesh' or 'dp_size'"),
        ('shardtool:{"url": "x", "dp_dim": "dp"}', "names dimensions of a 'mesh'"),
        ('shardtool:{"url": "x", "best_effort": "yes"}', "'best_effort' must be true or false"),
        ("shardtool:/a shardtool:/b", "holds 2 'shardtool:' requests"),
        ('shardtool:{"url": "x", "max_bytes": "lots"}', "cannot read request key 'max_bytes'"),
        ('shardtool:{"url": "x", "max_bytes": [1]}', "'max_bytes' must be a size"),
    ],
)
def test_malformed_requests_are_the_jobs_mistake(comment, message):
    with pytest.raises(RequestError, match=None) as e:
        parse_request(comment)
    assert message in str(e.value)


url_st = st.from_regex(r"(s3://[a-z]{1,8}/|/)[A-Za-z0-9_./-]{1,30}", fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(
    url_st,
    st.one_of(st.none(), st.sampled_from(["pp=2,dp=2", "dp=4,tp=2"])),
    st.one_of(st.none(), st.integers(1, 64)),
    st.booleans(),
    st.text(" abc=1", max_size=10),
)
def test_json_round_trip(url, mesh, rpn, best_effort, noise):
    body = {"url": url, "best_effort": best_effort}
    if mesh:
        body["mesh"] = mesh
    if rpn:
        body["ranks_per_node"] = rpn
    comment = f"{noise} shardtool:{json.dumps(body)} {noise}"
    r = parse_request(comment, workdir="/w")
    assert r == StageRequest(url, mesh=mesh, ranks_per_node=rpn, best_effort=best_effort)
    assert parse_request(f"{noise} shardtool:{url}") == StageRequest(url)


def test_comment_from_scontrol_line():
    line = (
        "JobId=7 JobName=t UserId=u(1) Command=/x/job.sh WorkDir=/x "
        'Comment=shardtool:{"url": "/d s", "mesh": "pp=2,dp=2"}  StdErr=/x/o StdIn=/dev/null Power='
    )
    assert comment_from_scontrol(line) == 'shardtool:{"url": "/d s", "mesh": "pp=2,dp=2"}'
    assert parse_request(comment_from_scontrol(line)).mesh == "pp=2,dp=2"
    assert comment_from_scontrol("JobId=7 Comment=(null) StdErr=/x") is None
    assert comment_from_scontrol("JobId=7 StdErr=/x") is None


# ------------------------------------------------------------------ who drains, who is told
@pytest.mark.parametrize("status", STATUSES)
def test_only_a_node_fault_exits_non_zero(status):
    assert prolog_exit_code(status) == (EXIT_LOCAL if status == "local_fault" else EXIT_OK)


def test_finding_severity():
    assert finding_severity("usage_error") == "error"
    for status in ("remote_failed", "partial", "cached"):
        assert finding_severity(status) == "warning"
    assert finding_severity("ok") is None and finding_severity("ok", warned=True) == "warning"


# ------------------------------------------------------------------ running jobs and eviction
records_st = st.dictionaries(
    st.sampled_from([str(j) for j in range(1, 9)]),
    st.lists(st.sampled_from(["v1", "v2", "v3", "v4"]), max_size=3).map(
        lambda vs: {"sources": [{"url": f"/d/{v}", "version": v} for v in vs]}
    ),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(records_st, st.one_of(st.none(), st.sets(st.sampled_from([str(j) for j in range(1, 12)]))))
def test_live_versions_and_stale_jobs(records, active):
    live = live_versions(records, active)
    stale = stale_jobs(records, active, keep="3")
    running = set(records) if active is None else set(records) & active
    assert live == {s["version"] for j in running for s in records[j]["sources"]}
    assert set(stale) == (set() if active is None else set(records) - active - {"3"})
    assert not set(stale) & running  # a running job's record is never removed
    if active is None:  # SLURM could not say: nothing is taken for finished
        assert stale == [] and live == {s["version"] for r in records.values() for s in r["sources"]}


entries_st = st.lists(
    st.builds(
        Entry,
        key=st.integers(0, 10_000),
        size=st.integers(1, 1000),
        assigned=st.booleans(),
        last_used=st.floats(0, 1e6, allow_nan=False),
        in_use=st.booleans(),
        protected=st.booleans(),
        idle=st.booleans(),
    ),
    max_size=30,
    unique_by=lambda e: e.key,
)


@settings(max_examples=200, deadline=None)
@given(entries_st, st.integers(0, 20_000))
def test_idle_versions_go_first_least_recently_used_first_never_in_use(entries, limit):
    order = eviction_order(entries)
    assert all(not e.in_use and not e.protected for e in order)
    keys = [(not e.idle, e.assigned, e.last_used) for e in order]
    assert keys == sorted(keys)
    used = sum(e.size for e in entries)
    victims, shortfall = plan_eviction(entries, used=used, limit=limit, incoming=0)
    if victims and any(not v.idle for v in victims):  # a running job's version only once no idle one is left
        assert all(e in victims for e in order if e.idle)


def test_an_idle_version_goes_before_a_running_jobs_even_if_more_recent_and_assigned():
    running_old = Entry(("v-run", 0), 10, assigned=False, last_used=1.0)
    idle_new = Entry(("v-idle", 0), 10, assigned=True, last_used=99.0, idle=True)
    idle_read = Entry(("v-idle", 1), 10, assigned=True, last_used=0.0, idle=True, in_use=True)
    victims, short = plan_eviction([running_old, idle_new, idle_read], used=30, limit=20, incoming=0)
    assert victims == [idle_new] and short == 0
