"""Held-out triples, velocity error and flow-matching loss on the tiny model."""
import copy

import pytest
import torch

import sparsevid as sv
from sparsevid_lab.data import ProceduralVideos
from sparsevid.eval import heldout_loss, velocity_error
from sparsevid.training import flow_matching_loss, noisy, predict_velocity
from sparsevid_lab.eval.heldout import heldout_set, predict_velocities, sampler_steps
from sparsevid_lab.model.builtin import BuiltinVideoDiT, tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return BuiltinVideoDiT(tiny_config()).eval()


@pytest.fixture(scope="module")
def heldout(model):
    return heldout_set(model, model.data, per_bin=2, num_bins=4)


def test_heldout_set_is_deterministic_and_stratified(model, heldout):
    again = heldout_set(model, model.data, per_bin=2, num_bins=4)
    assert torch.equal(again.samples.latents, heldout.samples.latents) and torch.equal(again.noise, heldout.noise)
    assert torch.equal(again.t, heldout.t) and torch.equal(again.samples.text, heldout.samples.text)
    assert heldout.samples.latents.shape == (8, *model.clip_shape) and heldout.bins.tolist() == [0, 1, 2, 3] * 2
    low, high = heldout.bins.double() / 4, (heldout.bins.double() + 1) / 4
    assert bool(((heldout.t >= low) & (heldout.t < high)).all())
    other = heldout_set(model, model.data, per_bin=2, num_bins=4, seed=5)
    assert not torch.equal(other.samples.latents, heldout.samples.latents)
    with pytest.raises(ValueError, match="per_bin"):
        heldout_set(model, model.data, per_bin=0)


def test_heldout_clips_come_from_the_models_data(model):
    plain = heldout_set(model, ProceduralVideos(frames=4, height=32, width=32, max_objects=2), per_bin=1, num_bins=2)
    textured = heldout_set(model, ProceduralVideos(frames=4, height=32, width=32, max_objects=2, background_texture=0.6,
                                            pan=0.3), per_bin=1, num_bins=2)
    # same scenes and captions, the texture only modulates the background
    assert torch.equal(plain.samples.text, textured.samples.text)
    assert not torch.equal(plain.samples.latents, textured.samples.latents)


def test_velocity_error_of_the_model_against_itself_is_zero(model, heldout):
    dense = predict_velocities(model, heldout, batch_size=3)
    again = predict_velocities(model, heldout, batch_size=8)
    error = velocity_error(again, dense, heldout)
    assert error["overall"] == pytest.approx(0.0, abs=1e-6) and len(error["per_bin"]) == 4
    # Every tile kept through the sparse path: the noise floor of the kernels, tiny in fp32.
    full = velocity_error(predict_velocities(model, heldout, sv.SparseConfig(rule="topk", topk=1.0)), dense, heldout)
    assert full["overall"] < 1e-5
    # One key block of four per row (75% sparsity): a real error in every bin.
    sparse = velocity_error(predict_velocities(model, heldout, sv.SparseConfig(rule="topk", topk=1)), dense, heldout)
    assert sparse["overall"] > 1e-3 and min(sparse["per_bin"]) > 0
    assert sparse["overall"] == pytest.approx(sum(sparse["per_bin"]) / 4)


def test_velocity_error_of_another_model(model, heldout):
    student = copy.deepcopy(model)
    with torch.no_grad():
        for p in student.transformer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    error = velocity_error(predict_velocities(student, heldout), predict_velocities(model, heldout), heldout)
    assert error["overall"] > 1e-3
    with pytest.raises(ValueError, match="one per held-out triple"):
        velocity_error(torch.zeros(3, 1), torch.zeros(3, 1), heldout)


def test_dense_steps_follow_the_sampler_step_of_each_noise_level(model, heldout):
    """A config dense for the first two sampler steps leaves the triples at those noise levels exact."""
    steps = sampler_steps(model, heldout.t)
    dense = predict_velocities(model, heldout)
    late = predict_velocities(model, heldout, sv.SparseConfig(rule="topk", topk=1, dense_steps=2))
    early = torch.tensor([s < 2 for s in steps])
    assert early.any() and (~early).any()
    # (batches differ in size between the two runs: equal up to fp32 rounding)
    assert torch.allclose(late[early], dense[early], atol=1e-5) and not torch.allclose(late[~early], dense[~early])


def test_flow_matching_loss_matches_the_training_loss(model, heldout):
    velocity = predict_velocities(model, heldout)
    loss = heldout_loss(velocity, heldout)
    with torch.no_grad():
        for b in range(4):
            index = (heldout.bins == b).nonzero().flatten()
            x0, noise, t = heldout.samples.latents[index], heldout.noise[index], heldout.t[index]
            direct = flow_matching_loss(predict_velocity(model.transformer, noisy(x0, noise, t), t,
                                                         heldout.samples.select(index)), x0, noise)
            assert loss["per_bin"][b] == pytest.approx(float(direct), rel=1e-5)
    assert loss["overall"] == pytest.approx(sum(loss["per_bin"]) / 4)
