"""The CPU threads drmas's torch work takes: its own cgroup's CPU quota, not the node's
core count that ``os.cpu_count()`` reports inside a container (issue 29, section 3)."""

from pathlib import Path

from drmas.infra import cpus


def cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_quota_is_read_from_cgroup_v2_and_v1_and_rounded_up(tmp_path):
    """A pod's CPU limit of 2500m is cpu.max "250000 100000" (v2) or a CFS quota of 250000
    per 100000 us (v1): 3 threads. "max" and -1 are no quota; no cgroup files, none."""
    assert cpus.cgroup_cpu_quota(cgroup(tmp_path / "a", {"cpu.max": "250000 100000\n"})) == 3
    assert cpus.cgroup_cpu_quota(cgroup(tmp_path / "b", {"cpu.max": "max 100000\n"})) is None
    v1 = {"cpu/cpu.cfs_quota_us": "1600000\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert cpus.cgroup_cpu_quota(cgroup(tmp_path / "c", v1)) == 16
    unlimited = {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}
    assert cpus.cgroup_cpu_quota(cgroup(tmp_path / "d", unlimited)) is None
    assert cpus.cgroup_cpu_quota(tmp_path / "missing") is None


def test_threads_follow_the_process_cgroup_and_omp_num_threads_still_wins(tmp_path, monkeypatch):
    """In a container limited to one CPU the process takes one thread whatever the node's
    core count; OMP_NUM_THREADS, set, is taken as it is (a user sharing a machine)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus.os, "cpu_count", lambda: 128)
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(128)))
    monkeypatch.setattr(cpus, "CGROUP_ROOT", cgroup(tmp_path / "one", {"cpu.max": "100000 100000\n"}))
    assert cpus.cpu_threads() == 1
    monkeypatch.setattr(cpus, "CGROUP_ROOT", cgroup(tmp_path / "none", {"cpu.max": "max 100000\n"}))
    assert cpus.cpu_threads() == 128
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {0, 1})  # taskset / a cpuset
    assert cpus.cpu_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpus.cpu_threads() == 3
    assert cpus.cpu_threads(environment=False) == 2  # a Ray actor: Ray's OMP_NUM_THREADS=1 is not the pod's


def test_a_pool_actor_shares_its_nodes_cpus_among_the_slots_it_advertises(monkeypatch):
    """A KubeRay pod with all of a node's 8 GPUs runs 8 slots' workers: each takes an eighth
    of the pod's CPUs (at least one), not all of them. (Ray's node table is a stand-in here:
    tests/test_rollout.py runs the real one on a local Ray.)"""
    import types

    import ray

    from drmas.generation import workers

    monkeypatch.setattr(workers, "cpu_threads", lambda environment=True: 128)
    context = types.SimpleNamespace(get_node_id=lambda: "b")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    nodes = [{"NodeID": "a", "Resources": {"GPU": 4.0}}, {"NodeID": "b", "Resources": {"GPU": 8.0, "CPU": 128.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert workers.slot_threads("GPU") == 16
    assert workers.slot_threads("pool_slot") == 128  # a node that advertises none: one slot
    assert workers.slot_threads(None) == 128
    nodes[1]["Resources"]["GPU"] = 256.0
    assert workers.slot_threads("GPU") == 1
