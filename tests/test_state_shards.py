"""The optimizer state saved per rank (drmas.training.shards) and resumed at any number of ranks.

Each rank stores only the ranges of each tensor it holds, in its own file; rank 0 adds the
index and commits. One script runs, per launch, every case (the torch engine, DeepSpeed
ZeRO-0 to -3, fp32 and bf16; ZeRO-3 with every parameter partitioned):

- ``save`` (2 ranks, then 1): N steps, the state stored per rank through the store and also
  gathered whole into one old-style ``optimizer.safetensors``; M more steps (the
  uninterrupted run); a fresh engine resumed from the shards, M steps: its state and
  weights must equal the uninterrupted run's, byte for byte.
- ``resume`` (1 and 3 ranks, from the state saved at 2 and at 1): a fresh engine from the
  shards and one from the whole file must hold the same state, equal to the saved one, and
  M steps later the same state and weights.
"""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import torch_env, torch_launcher
from safetensors import safe_open

import drmas.infra.store as store_module
from drmas.infra.store import CorruptArtifact, Store, StoreError
from drmas.stages.optimizer_store import store_shards
from drmas.training.shards import (
    RNG_FILE,
    ShardStream,
    even_pieces,
    load_optimizer_state,
    shard_file,
    shard_index,
    write_shard,
)
from drmas.training.state import read_range

CASES = [
    "torch-bfloat16",
    "zero0-bfloat16",
    "zero1-float32",
    "zero1-bfloat16",
    "zero2-float32",
    "zero2-bfloat16",
    "zero3-float32",
    "zero3-bfloat16",
]

SCRIPT = """
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM
sys.path.insert(0, sys.argv[1])
from helpers import ROOT, UPDATE_OVERRIDES
import drmas.training.engines.deepspeed as DS
from drmas.config import load_config
from drmas.infra.layout import PolicyRef
from drmas.infra.store import Store
from drmas.stages.update import import_stored_state
from drmas.training.engines import make_engine, rank_and_world
from drmas.training.engines.base import exchange_json
from drmas.stages.optimizer_store import store_shards
from drmas.training.state import load_state, save_state

N, M = 2, 2
mode, cases, sources, folder = sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(","), Path(sys.argv[5])
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")
rank, world = rank_and_world()
store = Store(str(folder / "store"))
deepspeed_config = DS.deepspeed_config


def every_parameter_partitioned(*args):  # DeepSpeed keeps parameters this small whole otherwise
    ds = deepspeed_config(*args)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return ds


DS.deepspeed_config = every_parameter_partitioned


def engine(case, start=None):  # over the initial weights, or an fp32 run's at step N (its masters)
    backend, dtype = case.split("-")
    overrides = [*UPDATE_OVERRIDES, "train.lr=1e-3", f"models.tiny.dtype={dtype}"]
    if backend == "torch":
        overrides.append("train.backend=torch")
    else:
        overrides += ["train.backend=deepspeed", f"train.zero_stage={backend[-1]}"]
    config = load_config(ROOT / "configs" / "math_tiny.yaml", overrides)
    shape = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(shape).to(getattr(torch, dtype))
    if start is not None and dtype == "float32":
        model.load_state_dict(start)
    return make_engine(model, config.worker_groups()[0], config)


def train(engine, steps, first):
    for step in range(first, first + steps):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine.forward_model(input_ids=ids.to(engine.device), labels=ids.to(engine.device)).loss
        engine.backward(loss, boundary=True)
        assert engine.step(engine.grad_norm())[0]


def weights(engine):
    return engine.full_weights() or {n: p.detach().cpu().clone() for n, p in engine.model.named_parameters()}


def unequal(expected, found):
    assert expected.keys() == found.keys(), (sorted(expected), sorted(found))
    return sorted(key for key in expected if not torch.equal(expected[key], found[key]))


def from_shards(case, saved_at, label, start=None):
    resumed = engine(case, start)
    scratch = folder / f"scratch-{label}-{case}-{saved_at}-of-{world}-{rank}"
    import_stored_state(resumed, store, PolicyRef(f"{case}/at{saved_at}"), scratch)
    return resumed, sorted(p.name for p in scratch.iterdir() if p.name.startswith("optimizer-"))


def compare(first, second):
    train(first, M, N)
    train(second, M, N)
    states = unequal(first.export_state().tensors, second.export_state().tensors)
    return states + unequal(weights(first), weights(second))


report = {}
for case in cases:
    row = {}
    if mode == "save":
        straight = engine(case)
        train(straight, N, 0)
        scratch = folder / f"scratch-save-{case}-{world}-{rank}"
        store_shards(straight.shard_stream(), store, f"{case}/at{world}", False, {}, scratch, 600)
        exported = straight.export_state()
        if rank == 0:
            save_state(exported, folder / case / f"whole{world}")
        whole = {name: tensor.clone() for name, tensor in exported.tensors.items()}  # (the torch engine's are live)
        at_n = weights(straight)
        train(straight, M, N)
        resumed, row["downloaded"] = from_shards(case, world, "self", at_n)
        row["resumed_state_unequal"] = unequal(whole, resumed.export_state().tensors)
        train(resumed, M, N)
        row["unequal"] = unequal(straight.export_state().tensors, resumed.export_state().tensors)
        row["unequal"] += unequal(weights(straight), weights(resumed))
    else:
        for saved_at in sources:
            sharded, downloaded = from_shards(case, saved_at, "resume")
            whole = engine(case)
            whole.import_state(load_state(folder / case / f"whole{saved_at}"))
            saved = load_state(folder / case / f"whole{saved_at}").tensors
            row[saved_at] = {
                "downloaded": downloaded,
                "sharded_unequal_saved": unequal(dict(saved), sharded.export_state().tensors),
                "whole_unequal_saved": unequal(dict(saved), whole.export_state().tensors),
                "unequal_after_steps": compare(sharded, whole),
            }
    report[case] = row
everyone = exchange_json(report, dist.group.WORLD if dist.is_initialized() else None)
if rank == 0:
    print("REPORT", json.dumps(everyone))
if dist.is_initialized():  # leave the group before exit: gloo torn down by the exit aborts a rank now and then
    dist.barrier()
    dist.destroy_process_group()
"""


def launch(folder: Path, mode: str, ranks: int, sources: str = "-") -> list[dict]:
    script = folder / "script.py"
    script.write_text(SCRIPT)
    args = [str(Path(__file__).parent), mode, ",".join(CASES), sources, str(folder)]
    done = subprocess.run(
        [*torch_launcher(ranks), str(script), *args], capture_output=True, text=True, env=torch_env(), timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.split("REPORT ")[-1].splitlines()[0])


def stored_elements(path: Path) -> dict[str, int]:
    """Elements of each tensor of a safetensors file, from its header."""
    with safe_open(str(path), framework="pt") as opened:
        return {key: _numel(opened.get_slice(key).get_shape()) for key in opened.keys()}


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], list[dict]]:
    """The state of every case saved at 2 ranks and at 1 (and each resumed where it was saved)."""
    folder = tmp_path_factory.mktemp("shards")
    return folder, launch(folder, "save", 2), launch(folder, "save", 1)


@pytest.mark.slow
def test_each_rank_stores_only_its_own_ranges(saved):
    folder, _, _ = saved
    for case in CASES:
        stored = folder / "store" / case / "at2"
        index = json.loads((stored / "index.json").read_text())
        files = [stored_elements(stored / shard_file(rank, 2)) for rank in (0, 1)]
        whole = stored_elements(folder / case / "whole2" / "optimizer.safetensors")
        rng = whole.pop("rng/torch")
        assert stored_elements(stored / RNG_FILE) == {"rng/torch": rng}  # rank 0's RNG, whole, on its own
        assert sum(sum(f.values()) for f in files) == sum(whole.values()), case  # each element stored once
        largest = max(whole.values())
        for rank, held in enumerate(files):
            assert sum(held.values()) <= sum(whole.values()) / 2 + 3 * largest, (case, rank)
            for name, count in held.items():
                (chunk,) = [c for c in index["tensors"][name]["chunks"] if c["file"] == shard_file(rank, 2)]
                assert chunk["stop"] - chunk["start"] == count, (case, name)
        both_hold = [name for name in whole if all(name in held for held in files)]
        assert both_hold, case  # the state is split, not given to one rank


@pytest.mark.slow
def test_a_resume_at_the_saving_ranks_continues_bit_identically(saved):
    _, at_two, at_one = saved
    for report in (at_two, at_one):
        for case in CASES:
            assert report[0][case]["resumed_state_unequal"] == [], case
            assert report[0][case]["unequal"] == [], case


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "sources"), [(1, "2,1"), (2, "1"), (3, "2,1")])
def test_a_resume_at_another_number_of_ranks_gives_the_whole_files_state(saved, ranks, sources):
    """Saved at 2 (and at 1), resumed at 1 and 3; saved at 1, resumed at 2: the shards give
    exactly the state the whole file gives, and training goes on alike. ZeRO-1/2/3 ranks
    download only the shard files that hold their ranges."""
    folder, _, _ = saved
    report = launch(folder, "resume", ranks, sources)
    for case in CASES:
        for source in sources.split(","):
            row = report[0][case][source]
            assert row["sharded_unequal_saved"] == row["whole_unequal_saved"] == [], (case, source)
            assert row["unequal_after_steps"] == [], (case, source)
    if ranks == 3:  # ZeRO-3 splits each parameter alone: a third of it lies within one half
        assert report[0]["zero3-float32"]["2"]["downloaded"] == [shard_file(0, 2)]
        assert report[2]["zero3-float32"]["2"]["downloaded"] == [shard_file(1, 2)]
        assert report[1]["torch-bfloat16"]["2"]["downloaded"] == [shard_file(0, 2), shard_file(1, 2)]


# -- the format and the store, in one process ---------------------------------------------


def sharded_folder(folder: Path, world: int = 2) -> dict[str, torch.Tensor]:
    """A state split over ``world`` ranks as ``store_shards`` writes it (the RNG on rank 0),
    written by this one process; the whole tensors."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "optim/w/exp_avg": torch.randn(3, 5, generator=generator),
        "master/w": torch.randn(7, generator=generator),
    }
    chunks = []
    for rank in range(world):
        stream = ShardStream.of(even_pieces(tensors, rank, world), {"scheduler": {}, "steps": {"w": 1.0}})
        chunks.append(write_shard(stream, folder, rank, world))
    (folder / "index.json").write_text(json.dumps(shard_index(stream, chunks)))
    (folder / "state.json").write_text(json.dumps(stream.meta))
    (folder / RNG_FILE).write_bytes(stream.rng_file())
    return tensors | {"rng/torch": stream.rng}


def test_ranges_and_whole_tensors_read_from_the_shards_that_hold_them(tmp_path):
    tensors = sharded_folder(tmp_path, world=3)
    fetched: list[str] = []
    state = load_optimizer_state(tmp_path, lambda name: fetched.append(name) or tmp_path / name)
    assert torch.equal(read_range(state.tensors, "optim/w/exp_avg", 0, 4), tensors["optim/w/exp_avg"].reshape(-1)[:4])
    assert fetched == [shard_file(0, 3)]  # 15 elements in three: the first holds 0-4
    assert torch.equal(
        read_range(state.tensors, "optim/w/exp_avg", 4, 11), tensors["optim/w/exp_avg"].reshape(-1)[4:11]
    )
    assert fetched == [shard_file(0, 3), shard_file(1, 3), shard_file(2, 3)]
    for name, tensor in tensors.items():
        assert torch.equal(state.tensors[name], tensor), name
    assert state.tensors.shape("optim/w/exp_avg") == (3, 5)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda path: path.unlink(), f"{shard_file(1, 2)} is missing or not a safetensors file"),
        (lambda path: path.write_bytes(path.read_bytes()[:-8]), f"{shard_file(1, 2)} is missing or not a safetensors"),
        (lambda path: path.write_bytes(pickle.dumps({"planted": 1})), f"{shard_file(1, 2)} is missing or not a safet"),
    ],
    ids=["missing", "truncated", "pickle"],
)
def test_a_missing_or_damaged_shard_is_refused_naming_it(tmp_path, damage, message):
    sharded_folder(tmp_path)
    damage(tmp_path / shard_file(1, 2))
    state = load_optimizer_state(tmp_path)
    with pytest.raises(ValueError, match=message):
        state.tensors["master/w"]


def test_an_index_whose_chunks_do_not_tile_a_tensor_is_refused(tmp_path):
    sharded_folder(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    index["tensors"]["master/w"]["chunks"].pop()
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="the chunks of master/w do not cover it exactly once"):
        load_optimizer_state(tmp_path)
    index["tensors"]["master/w"]["chunks"] = [{"file": "../x", "key": "master/w", "start": 0, "stop": 7}]
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'../x' is not an optimizer shard's name"):
        load_optimizer_state(tmp_path)


def test_a_corrupt_stored_shard_is_refused_on_download_naming_it(tmp_path):
    from drmas.infra.layout import PolicyRef
    from drmas.stages.update import import_stored_state

    store = Store(str(tmp_path / "store"))
    local = tmp_path / "local"
    sharded_folder(local)
    with store.writer("run/optim") as out:
        out.put_dir(local, "")
    (tmp_path / "store" / "run" / "optim" / shard_file(1, 2)).write_bytes(b"x" * 100)

    class Engine:
        def import_state(self, state):
            state.tensors["master/w"]

    with pytest.raises(CorruptArtifact, match=f"{shard_file(1, 2)}: 100 bytes, but the manifest says"):
        import_stored_state(Engine(), store, PolicyRef("run/optim"), tmp_path / "scratch")


def _store_rank(rank: int, rendezvous: str, root: str, failing: int | None, results: dict) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    store = Store(root)
    if rank == failing:
        store.put_part = lambda *args: (_ for _ in ()).throw(OSError("disk gone"))  # type: ignore[method-assign]
    tensors = {"master/w": torch.arange(10, dtype=torch.float32)}
    stream = ShardStream.of(even_pieces(tensors, rank, 2), {"scheduler": {}, "steps": {}})
    try:
        store_shards(stream, store, "run/optim", False, {}, Path(root) / f"scratch{rank}", 60)
        results[rank] = "stored"
    except StoreError as error:
        results[rank] = str(error)
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.parametrize("failing", [None, 1])
def test_every_rank_stores_its_shard_and_a_failure_anywhere_leaves_no_artifact(tmp_path, failing):
    root = str(tmp_path / "store")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_store_rank, args=(f"file://{tmp_path / 'rendezvous'}", root, failing, results), nprocs=2)
        outcome = dict(results)
    store = Store(root)
    if failing is None:
        assert outcome == {0: "stored", 1: "stored"}
        artifact = store.open("run/optim")
        assert sorted(artifact.files) == sorted(
            ["index.json", "state.json", RNG_FILE, shard_file(0, 2), shard_file(1, 2)]
        )
        state = load_optimizer_state(artifact.download(tmp_path / "down"))
        assert torch.equal(state.tensors["master/w"], torch.arange(10, dtype=torch.float32))
    else:
        assert all("rank 1: OSError: disk gone" in message for message in outcome.values()), outcome
        assert not store.exists("run/optim")
        assert not (tmp_path / "store" / "run" / "optim").exists()  # rank 0's writer discarded the parts


def test_an_existing_artifact_is_kept_and_every_rank_told(tmp_path, monkeypatch):
    """Alone: an artifact already there is refused (not overwritten, not deleted)."""
    monkeypatch.setattr(store_module, "CHUNK_BYTES", 16)
    store = Store(str(tmp_path / "store"))
    tensors = {"master/w": torch.arange(10, dtype=torch.float32)}
    stream = ShardStream.of(even_pieces(tensors, 0, 1), {"scheduler": {}, "steps": {}})
    store_shards(stream, store, "run/optim", False, {}, tmp_path / "scratch", 60)
    with pytest.raises(StoreError, match="already holds a complete artifact"):
        store_shards(stream, store, "run/optim", False, {}, tmp_path / "scratch", 60)
    assert store.exists("run/optim")
