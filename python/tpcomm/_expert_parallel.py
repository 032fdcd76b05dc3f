"""Expert-parallel token exchange behind GroupCoordinator.dispatch/combine.

The E experts are owned in contiguous blocks: rank r owns experts
[r * E/n, (r + 1) * E/n). dispatch sends each token to every rank owning one
of its top-k experts (all ranks when top_k is None) with one all-to-all per
tensor over the device group; the per-pair counts differ and are exchanged
first over the CPU group. combine sends the results back along the same plan
and sums, per token, the rows from each rank it went to, in rank order (fixed
order, float32 accumulation for 16-bit types: the same bits on every run).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Plan:
    tokens: int
    index_per_rank: list  # token indices sent to each rank, on the tensors' device
    send_counts: list
    recv_counts: list


def _destinations(router_logits, world_size, top_k):
    """[tokens, world_size] bool on CPU: which ranks each token goes to."""
    tokens, experts = router_logits.shape
    if top_k is None:
        return torch.ones(tokens, world_size, dtype=torch.bool)
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"dispatch: top_k {top_k!r} must be an integer in 1..{experts}")
    owners = (router_logits.topk(top_k, dim=-1).indices // (experts // world_size)).cpu()
    mask = torch.zeros(tokens, world_size, dtype=torch.bool)
    mask.scatter_(1, owners, True)
    return mask


def _check(hidden_states, router_logits, extras, world_size):
    if router_logits.dim() != 2:
        raise ValueError(f"dispatch: router_logits must be [tokens, experts], got shape "
                         f"{tuple(router_logits.shape)}")
    tokens, experts = router_logits.shape
    if experts % world_size:
        raise ValueError(f"dispatch: {experts} experts do not divide over {world_size} ranks")
    for name, t in [("hidden_states", hidden_states)] + [(f"extra_tensors[{i}]", e)
                                                        for i, e in enumerate(extras)]:
        if t.dim() == 0 or t.shape[0] != tokens:
            raise ValueError(f"dispatch: {name} has shape {tuple(t.shape)}; its first dim must "
                             f"be the {tokens} tokens of router_logits")


def _exchange(group, tensor, out_rows, out_splits, in_splits):
    out = tensor.new_empty((out_rows,) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
    return out


def dispatch_tokens(coordinator, hidden_states, router_logits, extra_tensors, top_k):
    n = coordinator.world_size
    extras = list(extra_tensors) if extra_tensors is not None else []
    _check(hidden_states, router_logits, extras, n)
    mask = _destinations(router_logits, n, top_k)
    index_cpu = [mask[:, r].nonzero().flatten() for r in range(n)]
    send_counts = [int(ix.numel()) for ix in index_cpu]
    recv = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(recv, torch.tensor(send_counts, dtype=torch.int64),
                           group=coordinator.cpu_group)
    recv_counts = recv.tolist()
    device = hidden_states.device
    index = [ix.to(device) for ix in index_cpu]
    order = torch.cat(index)
    rows = sum(recv_counts)

    def send(t):
        return _exchange(coordinator.device_group, t.index_select(0, order.to(t.device)), rows,
                         recv_counts, send_counts)

    received = (send(hidden_states), send(router_logits))
    if extra_tensors is not None:
        received += ([send(e) for e in extras],)
    return Plan(router_logits.shape[0], index, send_counts, recv_counts), received


def combine_tokens(coordinator, plan, hidden_states):
    rows = sum(plan.recv_counts)
    if hidden_states.dim() == 0 or hidden_states.shape[0] != rows:
        raise ValueError(f"combine: expected {rows} rows (the tokens dispatch delivered to this "
                         f"rank), got shape {tuple(hidden_states.shape)}")
    back = _exchange(coordinator.device_group, hidden_states, sum(plan.send_counts),
                     plan.send_counts, plan.recv_counts)
    wide = hidden_states.dtype in (torch.float16, torch.bfloat16)
    acc_dtype = torch.float32 if wide else hidden_states.dtype
    out = torch.zeros((plan.tokens,) + tuple(hidden_states.shape[1:]), dtype=acc_dtype,
                      device=hidden_states.device)
    start = 0
    for index, count in zip(plan.index_per_rank, plan.send_counts):
        # Indices are unique within one rank's block: each add is the only one
        # to its row, so the result does not depend on scheduling.
        out.index_add_(0, index, back[start:start + count].to(acc_dtype))
        start += count
    return out.to(hidden_states.dtype)


# ------------------------------------------------ all-gather / reduce-scatter
# vLLM's dispatch(hidden_states, topk_weights, topk_ids) and
# dispatch_router_logits: every rank receives every rank's tokens (an
# all_gatherv along dim 0, by source rank then token order) and runs its own
# experts on them; combine sums the ranks' results for each token and hands
# each rank its own tokens back (a reduce_scatterv).


@dataclass
class GatherPlan:
    sizes: list  # tokens per rank of `group`
    group: object = None  # the coordinator gathered over; None: nothing moved


def _check_rows(name, tensors, tokens):
    for i, t in enumerate(tensors):
        if t.dim() == 0 or t.shape[0] != tokens:
            raise ValueError(f"{name}: tensor {i} has shape {tuple(t.shape)}; its first dim "
                             f"must be the {tokens} tokens of hidden_states")


def gather_tokens(coordinator, name, tensors):
    """all_gatherv of `tensors` (each [tokens, ...]) with the token counts
    exchanged once: (plan, gathered tensors)."""
    tokens = tensors[0].shape[0] if tensors[0].dim() else -1
    _check_rows(name, tensors, tokens)
    if coordinator.world_size == 1:
        return GatherPlan([tokens]), list(tensors)
    sizes = coordinator._sizes(tokens, None, name)
    return (GatherPlan(sizes, coordinator),
            coordinator.all_gatherv(list(tensors), dim=0, sizes=sizes))


def scatter_tokens(plan, hidden_states):
    rows = sum(plan.sizes)
    if hidden_states.dim() == 0 or hidden_states.shape[0] != rows:
        raise ValueError(f"combine: expected {rows} rows (every rank's tokens, as dispatch "
                         f"gathered them), got shape {tuple(hidden_states.shape)}")
    if plan.group is None:
        return hidden_states
    return plan.group.reduce_scatterv(hidden_states, dim=0, sizes=plan.sizes)


def own_tokens(plan):
    """How many rows combine returns on this rank."""
    if isinstance(plan, GatherPlan):
        return plan.sizes[plan.group.rank_in_group if plan.group is not None else 0]
    return plan.tokens


# The groups initialize_model_parallel made, as (expert-parallel,
# data-parallel, prefill-context-parallel) or None each: parallel_state
# registers a function that returns them (parallel_groups), so that this
# module, below both the coordinator and parallel_state, imports neither.
_parallel_groups = None


def parallel_groups(groups):
    """Registers `groups()`, the (ep, dp, pcp) groups moe_group reads."""
    global _parallel_groups
    _parallel_groups = groups


def moe_group(coordinator, is_sequence_parallel):
    """The group vLLM 0.33's all-gather dispatch runs over when called on
    `coordinator`: itself, unless it is the expert-parallel group that
    initialize_model_parallel made and the tokens are not sequence
    parallel: then the data-parallel group (tensor-parallel peers hold the
    same tokens and reduce their results themselves), or, with one
    data-parallel replica, the prefill-context group; with several
    replicas and prefill context parallelism, itself again."""
    ep, dp, pcp = _parallel_groups() if _parallel_groups is not None else (None, None, None)
    if is_sequence_parallel or ep is None or coordinator is not ep:
        return coordinator
    if dp is not None and dp.world_size > 1:
        return coordinator if pcp is not None and pcp.world_size > 1 else dp
    return pcp if pcp is not None else coordinator
