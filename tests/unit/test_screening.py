"""The screen flags a worker whose reply sizes stand out from its stage's other workers', after a
few samples, and leaves honest workers with ordinary sample-to-sample spread alone."""

import math
import random

import torch

from roles.trainer.screening import RECENT, Screening, coherence, loss_size, reply_size
from protocol.messages import BackwardReply
from roles.trainer.spot_checks import LISTING_EVERY, SpotChecks


def _feed(screen, rng, liar_factor, samples, workers=("a", "b", "c")):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for i in range(samples):
        worker = workers[i % len(workers)]
        tensor = torch.randn(16, 8, generator=gen)
        if worker == "liar":
            tensor = liar_factor(tensor, gen)
        screen.observe(1, "output", worker, reply_size(tensor), i // 8)


def test_noise_as_large_as_the_output_or_a_scaled_output_is_flagged_within_a_few_of_its_samples():
    for attack in (lambda t, g: t + torch.randn(t.shape, generator=g), lambda t, g: 3 * t, lambda t, g: 0 * t):
        screen = Screening()
        _feed(screen, random.Random(1), attack, 4 * 2 * RECENT, workers=("a", "b", "c", "liar"))
        assert screen.suspect(1, "liar"), screen.summary()
        assert not any(screen.suspect(1, w) for w in "abc"), screen.summary()
        assert screen.flagged == {"liar": 1}
    screen.forget(1, "liar")  # excluded: the others are held against each other again
    _feed(screen, random.Random(2), lambda t, g: 0 * t, 4 * 3 * RECENT, workers=("a", "b", "c", "liar"))
    # (its replies still in flight are ignored)
    assert screen.summary()["suspects"] == {} and not screen.suspect(1, "liar")


def test_honest_workers_are_not_flagged_however_fast_the_run_moves_their_sizes():
    screen = Screening()
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    for i in range(6000):
        version = i // 8
        drift = math.exp(-version / 20)  # the run trains: sizes fall by a third every 20 versions
        worker = "a" if rng.random() < 0.1 else rng.choice("bcd")  # a slow worker among fast ones
        screen.observe(0, "output", worker, reply_size(torch.randn(64, generator=gen) * drift), version)
        screen.observe(0, "loss", worker, loss_size(5.0 * drift * (1 + 0.2 * float(torch.rand(1, generator=gen)))),
                       version)
    assert screen.flagged == {} and screen.summary()["suspects"] == {}


def test_a_suspect_is_checked_at_the_suspect_rate_and_the_others_at_the_base_rate():
    checks = SpotChecks(0.01, 0.01, None, lambda stage: [], random.Random(0), suspect_rate=0.5)
    for i in range(4 * RECENT):
        for worker in ("a", "b", "c"):
            checks.screening.observe(2, "loss", worker, loss_size(3.0 + 0.01 * (i % 5)), i // 4)
        checks.screening.observe(2, "loss", "liar", loss_size(9.0), i // 4)
    suspect = sum(checks.draw(2, "liar") for _ in range(2000))
    honest = sum(checks.draw(2, "a") for _ in range(2000))
    assert 850 <= suspect <= 1150 and honest <= 50, (suspect, honest)
    assert checks.stats.outcomes["targeted"] == suspect
    assert SpotChecks(0.0, 0.01, None, lambda stage: [], suspect_rate=0.5).draw(2, "liar") is False


def _residual_replies(gen, samples=64, width=8, positions=16):
    """Inputs and answers of a stage that adds to a residual stream: the answer is mostly its
    input (cosine about 0.85), as a trained body stage's is."""
    inputs = torch.randn(samples, positions, width, generator=gen)
    return inputs, inputs + 0.6 * torch.randn(samples, positions, width, generator=gen)


def test_another_sample_s_output_or_a_flipped_gradient_keeps_its_size_but_not_its_direction():
    gen = torch.Generator().manual_seed(0)
    inputs, answers = _residual_replies(gen)
    assert 0.8 < coherence(inputs[0], answers[0]) < 0.9
    assert coherence(inputs[0], None) is None and coherence(inputs[0], answers[0][:4]) is None
    assert coherence(inputs[0], torch.zeros_like(answers[0])) == 0.0
    assert coherence(inputs[0], answers[0] * float("nan")) != coherence(inputs[0], answers[0])
    lies = {"swap": lambda i: answers[(i + 1) % len(answers)], "flip": lambda i: -answers[i],
            "zero": lambda i: torch.zeros_like(answers[i])}
    for name, lie in lies.items():
        screen = Screening()
        for i in range(4 * 2 * RECENT):
            worker = ("a", "b", "c", "liar")[i % 4]
            answer = lie(i % len(answers)) if worker == "liar" else answers[i % len(answers)]
            screen.observe(1, "output_coherence", worker, coherence(inputs[i % len(inputs)], answer), i // 8)
        assert screen.suspect(1, "liar") and not any(screen.suspect(1, w) for w in "abc"), (name, screen.summary())
        assert screen.summary()["suspects"]["liar"]["kind"] == "output_coherence"


def test_honest_replicas_coherence_never_flags_them():
    gen = torch.Generator().manual_seed(1)
    inputs, answers = _residual_replies(gen, samples=2000)
    screen = Screening()
    rng = random.Random(0)
    for i in range(2000):
        worker = "a" if rng.random() < 0.1 else rng.choice("bcd")
        screen.observe(1, "gradient_coherence", worker, coherence(inputs[i], answers[i]), i // 8)
        screen.observe(1, "output_coherence", worker, coherence(inputs[i], answers[i]), i // 8)
    assert screen.flagged == {}


def test_a_liar_on_one_sample_in_ten_has_each_lie_checked_and_honest_replies_seldom_are():
    """The median of a worker's replies hides a rare lie; each lie stands out by itself."""
    gen = torch.Generator().manual_seed(2)
    inputs, answers = _residual_replies(gen, samples=4000)
    checks = SpotChecks(0.01, 0.01, None, lambda stage: ["honest", "liar"], random.Random(0))
    lies = drawn_lies = honest_outliers = 0
    for i in range(4000):
        worker = ("honest", "liar")[i % 2]
        answer = answers[i]
        lying = worker == "liar" and i % 20 == 1
        if lying:  # noise as large as the output
            answer = answer + torch.randn(answer.shape, generator=gen) * answer.std()
        outlier = checks.screening.stands_out(
            worker, checks.screening.observe(1, "output", worker, reply_size(answer), i // 8),
            checks.screening.observe(1, "output_coherence", worker, coherence(inputs[i], answer), i // 8))
        drawn = checks.draw(1, worker, outlier)
        lies += lying
        drawn_lies += lying and drawn
        honest_outliers += outlier and not lying
    assert drawn_lies >= 0.9 * lies, (drawn_lies, lies)
    assert honest_outliers <= 0.01 * (4000 - lies), honest_outliers
    assert not checks.screening.suspect(1, "honest")


def test_outlier_checks_are_bounded_per_worker():
    checks = SpotChecks(0.01, 0.01, None, lambda stage: [], random.Random(0))
    drawn = sum(checks.draw(1, "w", outlier=True) for _ in range(1000))
    assert drawn <= 0.2 * 1000 + RECENT + 15, drawn  # the share, its head start, and the base rate
    assert checks.stats.outcomes["outlier"] >= 0.2 * 1000


def test_a_worker_discovery_no_longer_lists_is_dropped_and_its_replica_no_longer_suspect():
    listed = {1: ["honest", "liar"]}
    checks = SpotChecks(0.01, 0.01, None, lambda stage: listed[stage], random.Random(0))
    reply = BackwardReply(loss=3.0, grad_input=torch.ones(4, 8))  # no version: a drawn hop is not checked
    for i in range(4 * RECENT):
        for worker, loss in (("honest", 3.0 + 0.01 * (i % 5)), ("liar", 9.0)):
            checks.screening.observe(1, "loss", worker, loss_size(loss), i // 4)
    assert checks.screening.suspect(1, "honest") and checks.screening.suspect(1, "liar")  # each other's yardstick
    listed[1] = ["honest"]  # the liar was revoked on another trainer's evidence
    for i in range(LISTING_EVERY):
        checks.on_tail(1, "honest", torch.zeros(1, 4, dtype=torch.long), None, reply)
    assert not checks.screening.suspect(1, "honest") and "liar" not in checks.screening.workers(1)
    assert "liar" not in checks._hops and "honest" in checks._hops  # its counts go too


def test_the_tally_of_a_pair_goes_with_a_worker_discovery_no_longer_lists():
    listed = {1: ["honest", "liar"]}
    checks = SpotChecks(0.01, 0.01, None, lambda stage: listed[stage], random.Random(0))
    checks.screening.observe(1, "loss", "liar", loss_size(3.0), 0)
    checks._signs[(1, frozenset(("honest", "liar")))]["liar"] += 5
    checks._signs[(2, frozenset(("other", "third")))]["other"] += 1
    listed[1] = ["honest"]
    reply = BackwardReply(loss=3.0, grad_input=torch.ones(4, 8))
    for i in range(LISTING_EVERY):
        checks.on_tail(1, "honest", torch.zeros(1, 4, dtype=torch.long), None, reply)
    assert list(checks._signs) == [(2, frozenset(("other", "third")))]


def test_with_two_replicas_a_liar_on_every_reply_stands_out_from_its_first_replies():
    """With two replicas every distance is between the liar and the honest one, so the distances'
    own spread is the liar's offset; the senders' own spread keeps the yardstick honest."""
    gen = torch.Generator().manual_seed(3)
    inputs, answers = _residual_replies(gen, samples=400)
    for name, lie in {"flip": lambda a: -a, "scale": lambda a: 3 * a}.items():
        screen = Screening()
        standing = {"honest": 0, "liar": 0}
        for i in range(400):
            worker = ("honest", "liar")[i % 2]
            answer = lie(answers[i]) if worker == "liar" else answers[i]
            standing[worker] += screen.stands_out(
                worker, screen.observe(1, "output", worker, reply_size(answer), i // 8),
                screen.observe(1, "output_coherence", worker, coherence(inputs[i], answer), i // 8))
        # the first 2 * RECENT distances set the yardstick: every later lie stands out
        assert standing["liar"] >= 200 - 2 * RECENT, (name, standing)
        # and so does its replica (each is the other's only reference): checks, never strikes


def test_honest_pairs_seldom_stand_out_while_the_run_moves_their_sizes():
    gen, rng = torch.Generator().manual_seed(4), random.Random(4)
    inputs, answers = _residual_replies(gen, samples=4000)
    screen = Screening()
    standing = 0
    for i in range(4000):
        version = i // 8
        drift = math.exp(-version / 20)
        worker = ("a", "b")[rng.random() < 0.5]
        standing += screen.stands_out(
            worker, screen.observe(1, "output", worker, reply_size(answers[i] * drift), version),
            screen.observe(1, "output_coherence", worker, coherence(inputs[i], answers[i]), version))
    assert standing <= 0.01 * 4000, standing


def test_a_liar_from_the_first_replies_stands_out_before_the_stage_has_a_measured_spread():
    gen = torch.Generator().manual_seed(5)
    inputs, answers = _residual_replies(gen, samples=2 * RECENT)
    screen = Screening()
    standing = {"honest": [], "liar": []}
    for i in range(2 * RECENT):
        worker = ("honest", "liar")[i % 2]
        answer = -answers[i] if worker == "liar" else answers[i]
        standing[worker].append(screen.stands_out(
            worker, screen.observe(1, "output", worker, reply_size(answer), 0),
            screen.observe(1, "output_coherence", worker, coherence(inputs[i], answer), 0)))
    # from the first reply with two of its replica's to be held against
    assert all(standing["liar"][2:]), standing
