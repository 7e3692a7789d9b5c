"""V-JEPA 2-AC (``walkserve.adapters.vjepa2_ac``) on CPU, no processes.

The cached rollout (one new block per step, K/V of earlier blocks reused) and the native
rollout (the predictor recomputed over the whole growing prefix each step) compute the same
function; they are compared within ``ROLLOUT_TOLERANCE`` of max|native| in float32. Why not
bitwise: a cached step multiplies a (N + 2)-row activation while the native step multiplies
T * (N + 2) rows, so BLAS blocks and sums the same dot products in another order (each
product ~1 float32 ulp apart, 1.2e-7 relative), and attention softmax sums run over the same
keys in differently sized kernels. Each prediction is fed back as the next input, so these
rounding differences ride along the rollout; the output LayerNorm keeps them from growing:
measured ~6e-7 of max|native| at horizons 4, 15 and 30. 1e-5 leaves a 15x margin while still
catching any real mismatch (a wrong position, mask or cache slice changes outputs by O(1)).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import VJEPA2Model

from walkserve import capture
from walkserve.adapters import vjepa2_ac as ac
from walkserve.adapters.vjepa2_ac_predictor import PredictorConfig

ROLLOUT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model() -> ac.VJEPA2AC:
    return ac.tiny()[0]


def request(model: ac.VJEPA2AC, horizon: int, batch: int = 2, context: int = 3) -> dict[str, Any]:
    return ac.sample_inputs(model, batch=batch, context=context, horizon=horizon, seed=horizon)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = ROLLOUT_TOLERANCE) -> None:
    assert got.shape == want.shape
    error = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert scale > 0.1  # not a degenerate (all-zero) rollout
    assert error <= tol * scale, f"max error {error:.3g} > {tol} x {scale:.3g}"


@pytest.mark.parametrize("horizon", [4, 15, 30])
def test_cached_rollout_equals_native(model: ac.VJEPA2AC, horizon: int) -> None:
    r = request(model, horizon)
    with torch.no_grad():
        cached = model.rollout(**r)["predicted"]
        native = model.rollout_native(**r)["predicted"]
    assert cached.shape == (2, horizon, 16, 48)
    assert_close(cached, native)
    # Different frames give different predictions: the rollout is not constant.
    assert (cached[:, -1] - cached[:, 0]).abs().max() > 1e-2


def test_single_context_frame(model: ac.VJEPA2AC) -> None:
    """F = 1: the prefill has no history blocks (an empty cache stays empty)."""
    r = request(model, 5, batch=1, context=1)
    with torch.no_grad():
        assert_close(model.rollout(**r)["predicted"], model.rollout_native(**r)["predicted"])


def test_block_causal_mask(model: ac.VJEPA2AC) -> None:
    """A change to block 3 (its frame, action or state) leaves the outputs of blocks 0..2
    unchanged and changes blocks 3 and 4; the cached prefill + step equals one full pass."""
    pred = model.predictor
    g = torch.Generator().manual_seed(1)
    frames = torch.randn(1, 5, 16, 48, generator=g)  # [B, T, N, De]
    actions, states = torch.randn(1, 5, 7, generator=g), torch.randn(1, 5, 7, generator=g)
    k0, v0 = pred.empty_cache(frames)
    with torch.no_grad():
        base, k, v = pred(frames, actions, states, k0, v0)
        for which in ("frame", "action", "state"):
            f2, a2, s2 = frames.clone(), actions.clone(), states.clone()
            {"frame": f2, "action": a2, "state": s2}[which][:, 3] += 1.0
            out, _, _ = pred(f2, a2, s2, k0, v0)
            assert torch.allclose(out[:, :3], base[:, :3], rtol=0, atol=1e-6), which
            assert (out[:, 3:] - base[:, 3:]).abs().amin(dim=(2, 3)).gt(0).all(), which
        # Prefill 3 blocks, then feed blocks 3 and 4 against the cache.
        _, kp, vp = pred(frames[:, :3], actions[:, :3], states[:, :3], k0, v0)
        tail, k2, v2 = pred(frames[:, 3:], actions[:, 3:], states[:, 3:], kp, vp)
    assert kp.shape == (2, 1, 2, 3 * 18, 16)
    assert_close(tail, base[:, 3:])
    assert_close(k2, k)
    assert_close(v2, v)


def test_encoder_equals_vjepa2_model(model: ac.VJEPA2AC) -> None:
    frames = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    upstream: VJEPA2Model = model.encoder.model
    with torch.no_grad():
        got = model.encoder(frames)  # [B, F, N, D]
        for b in range(2):
            for f in range(3):
                clip = frames[b, f][None, None].repeat(1, 2, 1, 1, 1)  # [1, 2, 3, H, W]
                want = upstream(pixel_values_videos=clip, skip_predictor=True).last_hidden_state
                assert torch.allclose(got[b, f], want[0], rtol=0, atol=1e-5)


def test_goal_stops_both_rollouts_at_the_same_step(model: ac.VJEPA2AC) -> None:
    r = request(model, 8, batch=1)
    with torch.no_grad():
        full = model.rollout(**r)["predicted"]  # the goal is never reached at tolerance 0
        goal_tokens = model.encoder(r["goal"][:, None])[:, 0]
        dist = (full - goal_tokens[:, None]).abs().mean(dim=(2, 3))[0]  # [8]
        tol = dist.min().item() * (1 + 1e-3)
        steps = int((dist < tol).nonzero()[0].item()) + 1
        r["goal_tolerance"] = torch.tensor([tol])
        cached = model.rollout(**r)["predicted"]
        native = model.rollout_native(**r)["predicted"]
    assert cached.shape[1] == native.shape[1] == steps
    assert_close(cached, full[:, :steps])


def test_capture_records_a_dynamic_loop_carrying_the_cache(model: ac.VJEPA2AC) -> None:
    r = request(model, 6, batch=1)
    captured = capture.trace(model, r)
    text = captured.render("rollout")
    assert "dynamic loop cached_step x horizon" in text
    assert "carried     k_cache" in text and "carried     v_cache" in text
    assert "dynamic loop native_step x horizon" in captured.render("rollout_native")
    with torch.no_grad():
        for walk in ("rollout", "rollout_native"):
            eager = getattr(model, walk)(**r)["predicted"]
            assert torch.equal(captured.run(r, walk=walk)["predicted"], eager), walk


def test_checkpoint_round_trip(model: ac.VJEPA2AC, tmp_path: Path) -> None:
    ac.save_checkpoint(model, str(tmp_path))
    loaded, _ = ac.from_checkpoint(str(tmp_path))
    r = request(model, 4, batch=1)
    with torch.no_grad():
        assert torch.equal(loaded.rollout(**r)["predicted"], model.rollout(**r)["predicted"])
    (tmp_path / ac.PREDICTOR_WEIGHTS).unlink()
    with pytest.raises(ValueError, match="lacks"):
        ac.load_checkpoint(str(tmp_path))


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="heads"):
        PredictorConfig(embed_dim=48, grid=4, dim=60, heads=8)
    with pytest.raises(ValueError, match="positive int"):
        PredictorConfig(embed_dim=48, grid=0)
    with pytest.raises(ValueError, match="unknown"):
        PredictorConfig.from_dict({"embed_dim": 48, "grid": 4, "depth": 3})
    with pytest.raises(ValueError, match="encoder gives"):
        ac.VJEPA2AC(VJEPA2Model(ac.tiny_encoder_config()), PredictorConfig(embed_dim=32, grid=4))
