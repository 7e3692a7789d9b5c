"""pi0.5 (``walkserve.adapters.pi05``) on CPU, no processes.

The oracle for the cached action expert is ``native.joint_forward``: one attention per layer
over the whole ``[prefix; actions]`` sequence under the block-causal mask (backbone weights
for prefix tokens, expert weights for action tokens), recomputed from the inputs. The cached
path (PaliGemma's prefill keys and values, then the expert over the action tokens alone) must
equal it within ``TOLERANCE`` of max|reference| in float32: the two sum the same dot products
in differently shaped kernels (~1e-7 relative per op); a wrong mask, position or cache slice
changes velocities by O(1e-2) or more (see ``test_observation_moves_the_actions``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from walkserve import capture
from walkserve.adapters import pi05
from walkserve.adapters.pi05 import attention, native
from walkserve.adapters.pi05.prefix import discretise_state
from walkserve.adapters.registry import checkpoint_kind, load_model

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def policy() -> pi05.Pi05Policy:
    return pi05.tiny()[0]


def batch(policy: pi05.Pi05Policy, seed: int = 3) -> dict[str, Any]:
    """Three observations with full-length prompts, the last one ending in a pad token."""
    return pi05.sample_inputs(policy, batch=3, prompt_len=policy.cfg.max_prompt_len, seed=seed)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = TOLERANCE) -> None:
    assert got.shape == want.shape
    error = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert scale > 0.1, "a degenerate (all-zero) reference"
    assert error <= tol * scale, f"max error {error:.3g} > {tol} x {scale:.3g}"


def test_block_causal_mask_picture() -> None:
    """The module docstring's picture: image, text, padding, state | three actions."""
    valid = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    blocks = attention.sequence_blocks(5, 3, valid.device)
    prefix_row = [1, 1, 1, 0, 1, 0, 0, 0]
    action_row = [1, 1, 1, 0, 1, 1, 1, 1]
    want = torch.tensor([prefix_row] * 5 + [action_row] * 3, dtype=torch.bool)
    assert torch.equal(attention.block_causal_mask(valid, blocks)[0], want)
    assert torch.equal(attention.action_query_mask(valid[:, :5], 3)[0], want[5:])
    assert attention.positions(valid)[0].tolist() == [0, 1, 2, 2, 3, 4, 5, 6]


def test_expert_on_cached_prefix_equals_full_attention(policy: pi05.Pi05Policy) -> None:
    """The expert's attention to the backbone's cached keys and values equals one attention
    over [prefix; actions] with the block-causal mask, at several flow times; the cached
    prefix keys and values are those of the full pass."""
    r = batch(policy)
    obs = {k: r[k] for k in ("images", "prompt_ids", "state")}
    with torch.no_grad():
        prefix_k, prefix_v, prefix_mask = policy.prefix(**obs)
        assert not prefix_mask[-1].all() and prefix_mask[0].all()  # row 2 is padded
        for t in (torch.ones(3), torch.tensor([0.9, 0.35, 0.1])):
            x = r["noise"] * t[:, None, None]
            cached = policy.expert(x, t, prefix_k, prefix_v, prefix_mask)
            full, full_k, full_v = native.joint_forward(policy, **obs, x_t=x, t=t)
            assert_close(cached, full)
    assert_close(prefix_k, full_k)
    assert_close(prefix_v, full_v)


def test_padding_keys_are_never_seen(policy: pi05.Pi05Policy) -> None:
    r = batch(policy)
    obs = {k: r[k] for k in ("images", "prompt_ids", "state")}
    t = torch.full((3,), 0.5)
    with torch.no_grad():
        k, v, mask = policy.prefix(**obs)
        base = policy.expert(r["noise"], t, k, v, mask)
        pad = ~mask[None, :, None, :, None]  # [1, B, 1, P, 1]
        k2 = torch.where(pad, torch.randn_like(k) * 100, k)
        v2 = torch.where(pad, torch.randn_like(v) * 100, v)
        assert torch.equal(policy.expert(r["noise"], t, k2, v2, mask), base)
        # A prompt padded by the client is the same prompt (row 2 ends in one pad token).
        row = {name: value[2:] for name, value in obs.items()}
        unpadded = {**row, "prompt_ids": row["prompt_ids"][:, :-1]}
        assert torch.equal(policy.prefix(**unpadded)[0], policy.prefix(**row)[0])


def test_state_is_part_of_the_prefix(policy: pi05.Pi05Policy) -> None:
    """Why there is no walk reusing a prefix for a new state: a new state changes the keys
    of the image tokens from the second layer on (the first layer's keys are per token)."""
    r = batch(policy)
    obs = {k: r[k] for k in ("images", "prompt_ids", "state")}
    with torch.no_grad():
        k, _, _ = policy.prefix(**obs)
        k2, _, _ = policy.prefix(**{**obs, "state": -obs["state"]})
    vision = policy.prefix.paligemma.config.vision_config
    images = policy.cfg.num_cameras * (vision.image_size // vision.patch_size) ** 2  # first
    assert torch.equal(k2[0, :, :, :images], k[0, :, :, :images])
    assert (k2[1, :, :, :images] - k[1, :, :, :images]).abs().max() > 1e-3


def test_discretise_state_as_openpi_digitizes() -> None:
    """pi0.5's discretisation: ``np.digitize(s, np.linspace(-1, 1, 257)[:-1]) - 1``."""
    s = torch.tensor([[-1.5, -1.0, -0.99, -1 / 128, 0.0, 0.3, 0.999, 1.0, 2.0]])
    want = np.digitize(s.numpy(), np.linspace(-1, 1, 257)[:-1]) - 1
    assert discretise_state(s, 256).tolist() == np.clip(want, 0, 255).tolist()


def test_observation_moves_the_actions(policy: pi05.Pi05Policy) -> None:
    """Random weights, but not a degenerate policy: each of images, prompt and state moves
    the actions by far more than the tolerance."""
    r = pi05.sample_inputs(policy, batch=2, seed=5)
    changed = {
        "images": -r["images"],
        "prompt_ids": (r["prompt_ids"] + 1) % 700 + 1,
        "state": r["state"] * 0.5,
    }
    with torch.no_grad():
        base = policy.sample_actions(**r)
        for name, value in changed.items():
            moved = policy.sample_actions(**{**r, name: value})
            assert (moved - base).abs().max() > 100 * TOLERANCE * base.abs().max(), name


def test_native_baselines_equal_the_walks(policy: pi05.Pi05Policy) -> None:
    r = batch(policy, seed=4)
    with torch.no_grad():
        walks = policy.sample_actions(**r)
    assert torch.equal(native.sample_actions_cached(policy, **r), walks)
    assert_close(native.sample_actions_recompute(policy, **r), walks)


def test_rows_of_a_batch_are_independent(policy: pi05.Pi05Policy) -> None:
    r = batch(policy, seed=6)
    with torch.no_grad():
        together = policy.sample_actions(**r)
        for i in range(3):
            alone = policy.sample_actions(**{k: v[i : i + 1] for k, v in r.items()})
            assert_close(alone, together[i : i + 1])


def test_captured_walks_equal_eager(policy: pi05.Pi05Policy) -> None:
    captured = capture.trace(policy, pi05.sample_inputs(policy))
    act, denoise = captured.render("act"), captured.render("denoise")
    assert "state prefix_k, prefix_v, prefix_mask, flow_t; next denoise" in act
    assert "loop euler_step x10" in denoise
    assert "carried     x <- noise" in denoise and "carried     t <- flow_t" in denoise
    assert "invariant   prefix_k = prefix_k, prefix_v = prefix_v" in denoise
    for seed in (1, 2):
        r = pi05.sample_inputs(policy, batch=1, prompt_len=3 * seed, seed=seed)
        with torch.no_grad():
            eager = policy.sample_actions(**r)
        assert torch.equal(captured.run(r, walk="act")["actions"], eager)


def test_checkpoint_round_trip(policy: pi05.Pi05Policy, tmp_path: Path) -> None:
    pi05.save_checkpoint(policy, str(tmp_path))
    assert checkpoint_kind(str(tmp_path)) == "pi05"
    loaded, _sample = load_model(str(tmp_path))
    assert isinstance(loaded, pi05.Pi05Policy)
    r = batch(policy)
    with torch.no_grad():
        assert torch.equal(loaded.sample_actions(**r), policy.sample_actions(**r))
    (tmp_path / "expert.safetensors").unlink()
    with pytest.raises(ValueError, match="lacks"):
        pi05.load_checkpoint(str(tmp_path))


def test_bad_inputs_are_refused(policy: pi05.Pi05Policy) -> None:
    r = pi05.sample_inputs(policy)
    cases = {
        "images must be": {"images": r["images"][:, :1]},
        "L <= 12": {"prompt_ids": torch.ones(1, 13, dtype=torch.long)},
        "state tokens": {"prompt_ids": torch.full((1, 4), 1000)},
        "state must be \\[": {"state": r["state"][:, :3]},
        "state must be finite": {"state": r["state"] * float("nan")},
        "noise must be": {"noise": r["noise"][:, :5]},
    }
    for message, change in cases.items():
        with pytest.raises(ValueError, match=message), torch.no_grad():
            policy.sample_actions(**{**r, **change})


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="positive int"):
        pi05.Pi05Config(action_horizon=0)
    with pytest.raises(ValueError, match="even"):
        pi05.Pi05Config(expert_width=33)
    with pytest.raises(ValueError, match="unknown"):
        pi05.Pi05Config.from_dict({"horizon": 5})
    with pytest.raises(ValueError, match="larger than state_bins"):
        pi05.build(pi05.backbone_config(vocab=200), pi05.Pi05Config())
