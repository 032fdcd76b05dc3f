"""Model-parallel groups (vLLM's layout) and pipeline transfers between
tensor-parallel stages, on 4 real processes (TP=2 x PP=2)."""

import pytest
import torch

from test_message_queue import _step_dict, assert_dicts_equal


def test_layout_matches_vllm_arrangement():
    import tpcomm

    got = tpcomm.model_parallel_layout(8, tensor_model_parallel_size=2,
                                       pipeline_model_parallel_size=2, data_parallel_size=2)
    assert got["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert got["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert got["dp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert got["ep"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    got = tpcomm.model_parallel_layout(6, tensor_model_parallel_size=3)
    assert got["tp"] == [[0, 1, 2], [3, 4, 5]] and got["pp"] == [[r] for r in range(6)]
    with pytest.raises(ValueError, match="world size 4 is not a multiple of tensor \\(3\\)"):
        tpcomm.model_parallel_layout(4, tensor_model_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size must be a positive"):
        tpcomm.model_parallel_layout(4, pipeline_model_parallel_size=0)


def _stage_dict(tp_rank):
    g = torch.Generator().manual_seed(5)
    return {
        "hidden_states": torch.randn(6, 8, generator=g),  # replicated over TP: sliced
        "residual": torch.randn(6, 8, generator=g) + tp_rank,  # differs per TP rank: not sliced
        "odd": torch.arange(7, dtype=torch.int32),  # 7 elements do not split in 2
        "empty": torch.empty(0, 8),
        "step": 3,
    }


def _sent_bytes(pp, fn):
    import tpcomm

    before = tpcomm.stats(pp)["gloo"]["bytes"]
    fn()
    return tpcomm.stats(pp)["gloo"]["bytes"] - before


def _tp_by_pp(ctx):
    import tpcomm

    with pytest.raises(RuntimeError, match="not initialised"):
        tpcomm.get_tp_group()
    tpcomm.initialize_model_parallel(2, 2, device="cpu")
    try:
        tp, pp = tpcomm.get_tp_group(), tpcomm.get_pp_group()
        r = ctx.rank
        assert tp.ranks == [r - r % 2, r - r % 2 + 1] and pp.ranks == [r % 2, r % 2 + 2]
        assert tpcomm.get_dp_group().ranks == [r] and tpcomm.get_ep_group().ranks == tp.ranks
        assert tpcomm.get_world_group().ranks == [0, 1, 2, 3]
        assert tpcomm.get_tensor_model_parallel_world_size() == 2
        assert tpcomm.get_pipeline_model_parallel_rank() == r // 2
        assert tp.mq_broadcaster is not None and pp.mq_broadcaster is None

        # TP collectives inside each stage.
        x = torch.full((3,), float(r))
        assert torch.equal(tpcomm.tensor_model_parallel_all_reduce(x),
                           torch.full((3,), float(2 * (r - r % 2) + 1)))
        want = _step_dict(r // 2)
        got = tp.broadcast_tensor_dict(want if tp.rank_in_group == 0 else None)
        assert_dicts_equal(got, want)

        # Stage 0 -> stage 1, each TP rank to the same TP rank of the next stage.
        override = {"residual": False}
        mine = _stage_dict(tp.rank_in_group)
        if pp.is_first_rank:
            sliced = _sent_bytes(pp, lambda: pp.send_tensor_dict(
                mine, all_gather_group=tp, all_gather_tensors=override))
            whole = _sent_bytes(pp, lambda: pp.send_tensor_dict(mine))
            # Only the replicated tensor went as a half.
            assert whole - sliced == mine["hidden_states"].numel() * 4 // 2, (whole, sliced)
            assert pp.send_tensor_dict({"x": 1}, all_gather_group=tp) is None
        else:
            got = pp.recv_tensor_dict(all_gather_group=tp, all_gather_tensors=override)
            assert_dicts_equal(got, mine)
            assert_dicts_equal(pp.recv_tensor_dict(), mine)
            assert pp.recv_tensor_dict(all_gather_group=tp) == {"x": 1}
        tp.barrier()
    finally:
        tpcomm.destroy_model_parallel()
    with pytest.raises(ValueError, match="world size 4 is not a multiple of tensor \\(3\\)"):
        tpcomm.initialize_model_parallel(3, 1, device="cpu")
    assert not tpcomm.model_parallel_is_initialized()


def test_tp2_pp2_on_four_processes(groups):
    groups(4).run(_tp_by_pp)


def _tp_only(ctx):
    import tpcomm

    tpcomm.initialize_model_parallel(ctx.world_size, 1, device="cpu")
    try:
        tp = tpcomm.get_tp_group()
        x = torch.arange(6.0).reshape(2, 3) * (ctx.rank + 1)
        s = sum(range(1, ctx.world_size + 1))
        assert torch.equal(tpcomm.tensor_model_parallel_all_reduce(x), torch.arange(6.0)
                           .reshape(2, 3) * s)
        got = tpcomm.tensor_model_parallel_all_gather(x, dim=1)
        assert got.shape == (2, 3 * ctx.world_size)
        name = tp.unique_name
    finally:
        tpcomm.destroy_model_parallel()
    with pytest.raises(ValueError, match=f"no live tpcomm GroupCoordinator named '{name}'"):
        torch.ops.tpcomm.all_reduce(x, name)


def test_tensor_parallel_only(group):
    group.run(_tp_only)
