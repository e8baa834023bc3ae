"""Hugging Face checkpoints in and out of a sharded model: ``load_pretrained`` / ``save_pretrained`` beside
the usual ways, on one checkpoint, in one run (issue 50).

Makes its own checkpoint (a Llama built from a config, random weights, bf16, written by transformers in
several files), then at each world size, in the same gloo ranks, one way after another:

- in: ``load_pretrained`` into a meta-built model after ``fully_shard``; ``from_pretrained`` on every rank,
  then ``fully_shard``; rank 0 ``from_pretrained`` + ``set_model_state_dict(broadcast_from_rank0=True)``;
  meta model, ``fully_shard``, ``to_empty``, ``dcp.load(HuggingFaceStorageReader)`` (rotary buffers rebuilt
  by hand afterwards, else its logits are garbage);
- out: ``save_pretrained``; ``get_model_state_dict(full_state_dict, cpu_offload)`` + transformers'
  ``save_pretrained`` on rank 0; ``dcp.save(HuggingFaceStorageWriter(save_distributed, enable_consolidation))``.

Per way: seconds (the slowest rank), peak RSS growth per rank (``VmHWM`` over the RSS before it; the largest
rank), bytes read per rank (``rchar`` of ``/proc/self/io``; readers that ``mmap`` the files, as safetensors
does, read through page faults ``rchar`` does not count: marked so), and whether the result is exact (each
rank's shard equals its rows of the file, the rotary ``inv_freq`` equals the module's own; for a save, each
rank's rows of the written files equal its shard). fp32 parameters, one group per decoder layer.

    python benchmarks/bench_pretrained_io.py                    # ~1.5 GB bf16 checkpoint, 2 and 4 ranks
    python benchmarks/bench_pretrained_io.py --size 60MB --world-sizes 2
    python benchmarks/bench_pretrained_io.py --size 1.4GB --compare-loads 5 --profile --checkpoint /tmp/llama14
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import sys
import tempfile
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors go back to the OS: RSS shows live bytes

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import reset_peak_rss, rss_bytes  # noqa: E402

MiB = 2**20


def _llama_config(size_bytes: int):
    """A Llama config whose bf16 weights take about ``size_bytes``."""
    from transformers import LlamaConfig

    params = size_bytes // 2
    for hidden in (2048, 1024, 512, 256, 128):
        vocab = 32000 if hidden >= 1024 else 8000
        inter = hidden * 11 // 4
        kv = hidden // 2
        per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
        layers = round((params - 2 * vocab * hidden) / per_layer)
        if layers >= 4:
            break
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=max(layers, 1),
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
    )


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _shard(model) -> None:
    from fsdp_compose import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _shard(model)
    return model


def _way_ours_load(path, config):
    from fsdp_compose import load_pretrained

    model = _meta_model(config)
    load_pretrained(model, path)
    return model


def _way_every_rank(path, config):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _shard(model)
    return model


def _way_rank0_broadcast(path, config):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    if dist.get_rank() == 0:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        full = {k: v.clone() for k, v in model.state_dict().items()}
        _shard(model)
    else:
        model, full = _meta_model(config), {}
        model.to_empty(device="cpu")
        for module in model.modules():  # the rotary buffers only rank 0's from_pretrained computed
            if "RotaryEmbedding" in type(module).__name__:
                model._init_weights(module)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    return model


def _way_dcp_load(path, config):
    import torch.distributed.checkpoint as dcp

    model = _meta_model(config)
    model.to_empty(device="cpu")
    state = model.state_dict()
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
    for module in model.modules():  # by hand: after to_empty they hold garbage, and no file has them
        if "RotaryEmbedding" in type(module).__name__:
            model._init_weights(module)
    return model


def _way_first_touch(path, config):
    """What any load into a fresh sharded model pays, reading nothing: the model built on meta, sharded,
    materialized (``to_empty``), and every local tensor written once (the kernel zero-fills each page then)."""
    model = _meta_model(config)
    model.to_empty(device="cpu")
    for tensor in [*model.parameters(), *model.buffers()]:
        (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().zero_()
    return model


def _way_ours_save(model, out):
    from fsdp_compose import save_pretrained

    save_pretrained(model, out)


def _way_rank0_save(model, out):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(out, state_dict=full)
    dist.barrier()


def _way_dcp_save(model, out):
    import torch.distributed.checkpoint as dcp

    writer = dcp.HuggingFaceStorageWriter(out, save_distributed=True, enable_consolidation=True)
    dcp.save(model.state_dict(), storage_writer=writer)


def _shard_exact(model, path) -> bool:
    """Each rank's shard equals its rows of the checkpoint at ``path``, and inv_freq equals the module's own."""
    from safetensors import safe_open

    from fsdp_compose.extras.pretrained.checkpoint_dir import read_checkpoint
    from fsdp_compose.extras.pretrained.local_region import region_of

    entries = read_checkpoint(path)
    ok = True
    for name, param in model.named_parameters():
        entry = entries[name]
        region = region_of(param, name)
        with safe_open(entry.file, framework="pt") as f:
            rows = f.get_slice(name)[tuple(slice(s, s + n) for s, n in region.box)]
        ok &= torch.equal(param.to_local(), rows.to(param.dtype))
    rotary = model.model.rotary_emb
    inv_freq, _ = rotary.compute_default_rope_parameters(model.config)
    ok &= torch.equal(rotary.inv_freq, inv_freq)
    return bool(ok)


def _measure(fn, *args):
    gc.collect()
    dist.barrier()
    base, reads = rss_bytes(), _rchar()
    reset_peak_rss()
    start = time.perf_counter()
    result = fn(*args)
    seconds = time.perf_counter() - start
    stats = torch.tensor([seconds, (rss_bytes("VmHWM") - base) / MiB, (_rchar() - reads) / MiB], dtype=torch.float64)
    every = [torch.zeros_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(every, stats)
    return result, torch.stack(every)


def _compare_loads(rank: int, world: int, path: str, config, rounds: int, profile: bool) -> None:
    """``load_pretrained``, ``dcp.load(HuggingFaceStorageReader)`` and the first touch (the floor both share) in
    turn, ``rounds`` times each (alternating, so that a change of the machine's load falls on all); per round the slowest rank's seconds, the largest
    rank's peak RSS growth and the 1-minute load average; then the medians, their ratio and the RSS bound."""
    warm = _way_ours_load(path, config)  # imports and first-call costs, outside every measurement
    del warm
    _way_dcp_load(path, config)
    ways = {"ours": _way_ours_load, "dcp": _way_dcp_load, "first touch": _way_first_touch}
    times: dict[str, list[float]] = {key: [] for key in ways}
    rss: dict[str, list[float]] = {key: [] for key in ways}
    loads: list[float] = []
    exact = True
    for _ in range(rounds):
        for key, way in ways.items():
            loads.append(os.getloadavg()[0])
            model, stats = _measure(way, path, config)
            times[key].append(stats[:, 0].max().item())
            rss[key].append(stats[:, 1].max().item())
            if key != "first touch":
                exact &= _shard_exact(model, path)
            del model
    if profile:
        _profile_ours(rank, path, config)
    if rank == 0:
        fp32_share = _parameter_count(config) * 4 / world / MiB
        bound = 1.2 * fp32_share + 64
        median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        print(f"\n{world} ranks, {rounds} rounds (fp32 model / N = {fp32_share:,.0f} MiB; RSS bound 1.2x + 64 = {bound:,.0f} MiB); "
              f"load average {min(loads):.1f} to {max(loads):.1f}:")
        for key in times:
            print(f"  {key}: seconds {', '.join(f'{t:.2f}' for t in times[key])} (median {median[key]:.2f}); "
                  f"RSS growth MiB {', '.join(f'{r:,.0f}' for r in rss[key])}")
        print(f"  ours / dcp (medians): {median['ours'] / median['dcp']:.2f}x; exact: {exact}; the best any loader "
              f"could do against this dcp, reading in no time: first touch / dcp = {median['first touch'] / median['dcp']:.2f}x")
        sys.stdout.flush()


def _parameter_count(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def _profile_ours(rank: int, path: str, config) -> None:
    """One ``load_pretrained`` under cProfile on every rank; rank 0 prints what took its time."""
    import cProfile
    import pstats

    dist.barrier()
    profiler = cProfile.Profile()
    profiler.enable()
    _way_ours_load(path, config)
    profiler.disable()
    dist.barrier()
    if rank == 0:
        print("\nrank 0's load_pretrained, by own time:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
        sys.stdout.flush()


def _rank_main(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    config = _llama_config(args.size)
    if args.compare_loads:
        _compare_loads(rank, world, args.path, config, args.compare_loads, args.profile)
        dist.barrier()
        dist.destroy_process_group()
        return
    loads = [
        ("load_pretrained (ours)", _way_ours_load, ""),
        ("from_pretrained on every rank + fully_shard", _way_every_rank, " (mmap)"),
        ("rank 0 from_pretrained + set_model_state_dict(broadcast)", _way_rank0_broadcast, " (mmap)"),
        ("dcp.load(HuggingFaceStorageReader), rotary by hand", _way_dcp_load, " (mmap)"),
    ]
    rows = []
    warm = _way_ours_load(args.path, config)  # imports and first-call costs, outside every measurement
    _way_ours_save(warm, os.path.join(args.scratch, f"warm{world}"))
    _way_every_rank(args.path, config)
    del warm
    model = None
    for name, way, note in loads:
        model = None
        loaded, stats = _measure(way, args.path, config)
        exact = _shard_exact(loaded, args.path)
        rows.append((name, stats, note, exact))
        model = loaded
        del loaded
    saves = [
        ("save_pretrained (ours)", _way_ours_save, ""),
        ("full state dict (cpu_offload) + save_pretrained on rank 0", _way_rank0_save, ""),
        ("dcp.save(HuggingFaceStorageWriter, consolidated)", _way_dcp_save, ""),
    ]
    for number, (name, way, note) in enumerate(saves):
        out = os.path.join(args.scratch, f"out{world}_{number}")
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
        dist.barrier()
        _, stats = _measure(way, model, out)
        dist.barrier()  # a way may return on some ranks before rank 0 has finished writing
        exact = _shard_exact(model, out)
        rows.append((name, stats, note, exact))
    exact_everywhere = torch.tensor([[r[3] for r in rows]], dtype=torch.int32)
    dist.all_reduce(exact_everywhere, op=dist.ReduceOp.MIN)
    if rank == 0:
        fp32_share = sum(p.numel() for p in model.parameters()) * 4 / world / MiB
        print(f"\n{world} ranks (fp32 model / N = {fp32_share:,.0f} MiB):")
        print("| way | seconds | peak RSS growth per rank, MiB (max) | MiB read per rank (rchar, max) | exact |")
        print("| --- | --- | --- | --- | --- |")
        for (name, stats, note, _), exact in zip(rows, exact_everywhere[0].tolist()):
            seconds, rss, read = stats[:, 0].max(), stats[:, 1].max(), stats[:, 2].max()
            print(f"| {name} | {seconds:.2f} | {rss:,.0f} | {read:,.1f}{note} | {'yes' if exact else 'NO'} |")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def _bytes(text: str) -> int:
    """``1.5GB``, ``300MB``: decimal units, as ``max_shard_size`` reads them."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    return int(float(text[:-2]) * units[text[-2:].upper()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.5GB", help="bf16 checkpoint size, e.g. 1.5GB, 60MB")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--compare-loads", type=int, default=0, metavar="ROUNDS",
                        help="only load_pretrained against dcp.load(HuggingFaceStorageReader), ROUNDS times each; medians")
    parser.add_argument("--profile", action="store_true", help="with --compare-loads: one load of ours under cProfile")
    parser.add_argument("--checkpoint", help="keep the checkpoint in this directory and reuse it (made there if missing)")
    args = parser.parse_args()
    args.size = _bytes(args.size)
    import torch.multiprocessing as mp
    import transformers
    from transformers import AutoModelForCausalLM

    from benchmarks.common import _run_rank

    transformers.logging.set_verbosity_error()
    args.scratch = tempfile.mkdtemp(prefix="bench_pretrained_io_")
    args.path = args.checkpoint or os.path.join(args.scratch, "checkpoint")
    config = _llama_config(args.size)
    if not os.path.exists(os.path.join(args.path, "config.json")):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(args.path, max_shard_size="400MB")
    files = [f for f in os.listdir(args.path) if f.endswith(".safetensors")]
    size = sum(os.path.getsize(os.path.join(args.path, f)) for f in files)
    print(f"checkpoint: Llama, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{size / MiB:,.0f} MiB bf16 in {len(files)} file(s)")
    try:
        for world in (int(w) for w in args.world_sizes.split(",")):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(_run_rank, args=(_rank_main, world, port, args), nprocs=world, start_method="spawn")
    finally:
        shutil.rmtree(args.scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
