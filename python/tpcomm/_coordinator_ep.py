"""GroupCoordinator's expert-parallel methods (vLLM's surface): dispatch
in its two forms, combine and combine_into_output, pairing each combine with
the oldest dispatch not yet combined. The token exchange itself is
_expert_parallel's. A GroupCoordinator is one (coordinator.py); the
attributes it reads (world_size, unique_name, _ep_plans) are the
coordinator's."""

import torch

from tpcomm._expert_parallel import (GatherPlan, combine_tokens, dispatch_tokens,
                                     gather_tokens, moe_group, own_tokens, scatter_tokens)


class ExpertParallelMethods:
    def dispatch(self, hidden_states, *args, **kwargs):
        """Expert-parallel dispatch, in either of two forms:

        dispatch(hidden_states, topk_weights, topk_ids, is_sequence_parallel=False,
        extra_tensors=None), vLLM 0.33's: every rank receives every rank's
        tokens (an all-gather along dim 0, by source rank then token order),
        returns (hidden_states, topk_weights, topk_ids[, extra_tensors]) of
        them, and runs its own experts on all of them. On the
        expert-parallel group of initialize_model_parallel without
        `is_sequence_parallel`, as in vLLM, the tokens are gathered over the
        data-parallel group only (the prefill-context group with one
        replica): tensor-parallel peers hold the same tokens and all-reduce
        their results after combine.

        dispatch(hidden_states, router_logits, is_sequence_parallel=False,
        extra_tensors=None, top_k=None), the earlier form: an all-to-all. The
        E experts of router_logits ([tokens, E]) are owned in contiguous
        blocks of E / world_size by the ranks in order; each token goes only
        to the ranks owning its `top_k` experts (every rank when None);
        returns (hidden_states, router_logits[, extra_tensors]) of the
        received tokens, by source rank then token order.

        combine() then sends each rank's results back and sums them per
        token. In the earlier form `is_sequence_parallel` changes nothing;
        token counts are always exchanged."""
        topk = "topk_ids" in kwargs or (len(args) >= 2 and isinstance(args[1], torch.Tensor))
        if topk:
            return self._dispatch_topk(hidden_states, *args, **kwargs)
        return self._dispatch_router_logits(hidden_states, *args, **kwargs)

    def _dispatch_topk(self, hidden_states, topk_weights, topk_ids, is_sequence_parallel=False,
                       extra_tensors=None):
        tensors = [hidden_states, topk_weights, topk_ids] + list(extra_tensors or [])
        received = self._gather_dispatch("dispatch", tensors, is_sequence_parallel)
        head = tuple(received[:3])
        return head + (list(received[3:]),) if extra_tensors is not None else head

    def dispatch_router_logits(self, hidden_states, router_logits, is_sequence_parallel=False,
                               extra_tensors=None):
        """vLLM 0.33's dispatch of router logits: every rank receives every
        rank's tokens (as dispatch's topk form, over the same group); returns
        (hidden_states, router_logits[, extra_tensors]). combine() pairs with
        it."""
        tensors = [hidden_states, router_logits] + list(extra_tensors or [])
        received = self._gather_dispatch("dispatch_router_logits", tensors,
                                         is_sequence_parallel)
        head = tuple(received[:2])
        return head + (list(received[2:]),) if extra_tensors is not None else head

    def _gather_dispatch(self, name, tensors, is_sequence_parallel):
        if self.world_size == 1:
            return tensors
        plan, received = gather_tokens(moe_group(self, is_sequence_parallel), name, tensors)
        self._ep_plans.append(plan)
        return received

    def _dispatch_router_logits(self, hidden_states, router_logits, is_sequence_parallel=False,
                                extra_tensors=None, top_k=None):
        if self.world_size == 1:
            received = (hidden_states, router_logits)
            return received + (extra_tensors,) if extra_tensors is not None else received
        plan, received = dispatch_tokens(self, hidden_states, router_logits, extra_tensors,
                                         top_k)
        self._ep_plans.append(plan)
        return received

    def combine(self, hidden_states, is_sequence_parallel=False):
        """Sends each received token's result (rows in dispatch's order) back
        to its source and returns, per original token, the sum of the results
        from the ranks it went to (in rank order). Pairs with the oldest
        dispatch not yet combined."""
        if self.world_size == 1:
            return hidden_states
        if not self._ep_plans:
            raise RuntimeError(f"combine on group {self.unique_name} without a dispatch")
        plan = self._ep_plans[0]
        if isinstance(plan, GatherPlan):
            out = scatter_tokens(plan, hidden_states)  # checks before sending
        else:
            out = combine_tokens(self, plan, hidden_states)
        self._ep_plans.popleft()
        return out

    def allocate_combine_input(self, shape, dtype, device, is_sequence_parallel=False):
        """None: combine reads any tensor, so the caller allocates its input
        as it likes (vLLM's contract for "no special buffer")."""
        return None

    def combine_into_output(self, hidden_states, output, is_sequence_parallel=False):
        """combine() written into `output` (its shape checked before any
        communication), which is returned."""
        if self.world_size == 1:
            want = tuple(hidden_states.shape)
        elif not self._ep_plans:
            raise RuntimeError(f"combine_into_output on group {self.unique_name} without a "
                               "dispatch")
        else:
            rows = own_tokens(self._ep_plans[0])
            want = (rows,) + tuple(hidden_states.shape[1:])
        if tuple(output.shape) != want:
            raise ValueError(f"combine_into_output: output has shape {tuple(output.shape)}, "
                             f"the combined tokens have {want}")
        return output.copy_(self.combine(hidden_states, is_sequence_parallel))
