"""Worker of tests/test_expert_parallel.py: `torchrun --nproc_per_node=2 tests/expert_parallel_worker.py OUT TARGET`.

Every rank loads the MoE target whole, computes the reference (taps, final hidden state and a
speculative decode of its own prompts), then shards the target's experts over the two ranks and
computes the same again. The ranks feed different numbers of tokens, and rank 1 decodes three
prompts where rank 0 decodes one, inside ``uneven_forwards``. Writes ``OUT/rank<r>.json``.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from test_eval_decoder import TargetOracle  # noqa: E402

from dflash_train.config.schema import ModelConfig  # noqa: E402
from dflash_train.evaluate.decoder import StopRule, speculative_decode  # noqa: E402
from dflash_train.evaluate.session import TargetSession  # noqa: E402
from dflash_train.target import open_speech_target  # noqa: E402

TAPS = [1, 3, 6]  # the hybrid pattern M*-EM*ME: MoE blocks 3 and 6
K = 3


def _measure(target, inputs, prompts):
    taps = target.forward_taps(inputs, None, TAPS, return_last_hidden=True)
    decoded = []
    rule = StopRule(20, frozenset())
    with target.uneven_forwards():
        for embeds in prompts:
            oracle = TargetOracle(target, K, wrong_at=lambda r: r % K)
            out = speculative_decode(TargetSession(target, TAPS), oracle, embeds, rule)
            decoded.append({"tokens": out.token_ids, "accepted": out.accepted_per_round})
    return taps, decoded


def main() -> None:
    out, target_dir = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    target = open_speech_target(ModelConfig(pretrained_name=target_dir))
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(2, 9 + 6 * rank, target.hidden_size, generator=generator)  # 18 tokens here, 30 there
    prompts = [target.embed_tokens(torch.randint(0, 300, (1, 12 + 5 * i), generator=generator))
               for i in range(1 + 2 * rank)]
    whole, whole_decoded = _measure(target, inputs, prompts)
    target.shard_experts(2)
    sharded, sharded_decoded = _measure(target, inputs, prompts)
    experts = next(m for m in target.modules() if type(m).__name__ == "ShardedExperts").grouped.gate_and_up_projs
    result = {
        "tap_difference": (sharded.features - whole.features).abs().max().item(),
        "hidden_difference": (sharded.last_hidden - whole.last_hidden).abs().max().item(),
        "tap_scale": whole.features.abs().max().item(),
        "decoded_whole": whole_decoded,
        "decoded_sharded": sharded_decoded,
        "local_experts": experts.to_local().shape[0],
        "idle_forwards": target._lockstep.idle_forwards,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
