"""Actors on the workers, the learner on the coordinator: reinforcement learning with psclient.

The actor/learner pattern (as in IMPALA or SEED RL, in miniature): each worker
runs a "collect" `tf.function` that reads the current policy weights from the
ps once, plays a batch of episodes in an environment written in TensorFlow
ops (so it runs on the worker, inside the function), and returns the
trajectories through its future. The coordinator trains on each batch as it
arrives (REINFORCE with normalised reward-to-go) and schedules the next
collect at once, so actors never wait for the learner's turn and the learner
takes whichever batch is ready first.

The environment is the classic cart-pole (Barto, Sutton & Anderson 1983; the
dynamics and limits of Gym's CartPole-v0): push a cart left or right to keep
a pole upright; +1 per step, at most 200 steps. The stated goal is
CartPole-v0's "solved": a mean return of at least 195 over the last 100
episodes. A batch is collected with weights up to a few updates old (the
"policy lag" printed at the end); REINFORCE tolerates that here.

    python examples/actor_learner.py                 # 2 workers, 1 ps: about 10 s here, 2 s of it training
    python examples/actor_learner.py --workers 3 --envs 32 --json summary.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

# Cart-pole constants (Gym's CartPole-v0).
GRAVITY, CART_MASS, POLE_MASS, POLE_HALF_LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
X_LIMIT, THETA_LIMIT = 2.4, 12 * 2 * math.pi / 360
MAX_STEPS = 200
#: CartPole-v0's "solved": this mean return over the last SOLVED_WINDOW episodes.
SOLVED_RETURN, SOLVED_WINDOW = 195.0, 100


def cartpole_step(tf, state, action):
    """One Euler step of every environment in the batch: (next state, episode over)."""
    x, x_dot, theta, theta_dot = tf.unstack(state, axis=1)
    force = tf.where(action == 1, FORCE, -FORCE)
    cos, sin = tf.cos(theta), tf.sin(theta)
    total_mass = CART_MASS + POLE_MASS
    pole_moment = POLE_MASS * POLE_HALF_LENGTH
    temp = (force + pole_moment * theta_dot ** 2 * sin) / total_mass
    theta_acc = (GRAVITY * sin - cos * temp) / (
        POLE_HALF_LENGTH * (4.0 / 3.0 - POLE_MASS * cos ** 2 / total_mass))
    x_acc = temp - pole_moment * theta_acc * cos / total_mass
    state = tf.stack([x + TAU * x_dot, x_dot + TAU * x_acc, theta + TAU * theta_dot,
                      theta_dot + TAU * theta_acc], axis=1)
    over = (tf.abs(state[:, 0]) > X_LIMIT) | (tf.abs(state[:, 2]) > THETA_LIMIT)
    return state, over


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--envs", type=int, default=16, help="environments per collect call")
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--max-updates", type=int, default=400, help="give up after this many updates")
    parser.add_argument("--target", type=float, default=SOLVED_RETURN,
                        help=f"stop once the mean return of the last {SOLVED_WINDOW} episodes reaches it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the summary here as JSON")
    args = parser.parse_args(argv)

    import keras
    import tensorflow as tf

    import psclient

    keras.utils.set_random_seed(args.seed)
    envs, gamma = args.envs, args.gamma

    print(f"Starting a local cluster: {args.workers} workers, {args.ps} ps (127.0.0.1 only) ...", flush=True)
    with psclient.LocalCluster(num_workers=args.workers, num_ps=args.ps) as cluster:
        strategy = psclient.ParameterServerStrategy(cluster.cluster)
        try:
            with strategy.scope():  # The policy and Adam's slots live on the ps.
                policy = keras.Sequential([keras.Input((4,)), keras.layers.Dense(32, activation="tanh"),
                                           keras.layers.Dense(2)])
                optimizer = keras.optimizers.Adam(args.learning_rate)
                optimizer.build(policy.trainable_variables)

            @tf.function
            def collect(seed):
                """Actor, on a worker: `envs` episodes with the policy as it is on the ps now."""
                # One read of the weights from the ps; every step then uses this copy.
                weights = [tf.identity(v.value) for v in policy.trainable_variables]
                state = tf.random.stateless_uniform([envs, 4], seed, -0.05, 0.05)
                alive = tf.ones([envs], tf.bool)
                states = tf.TensorArray(tf.float32, MAX_STEPS)
                actions = tf.TensorArray(tf.int32, MAX_STEPS)
                alive_at = tf.TensorArray(tf.float32, MAX_STEPS)
                for t in tf.range(MAX_STEPS):
                    logits, _ = policy.stateless_call(weights, [], state)
                    step_seed = tf.random.experimental.stateless_fold_in(seed, t)
                    action = tf.cast(tf.random.stateless_categorical(logits, 1, step_seed)[:, 0], tf.int32)
                    states = states.write(t, state)
                    actions = actions.write(t, action)
                    alive_at = alive_at.write(t, tf.cast(alive, tf.float32))  # Reward 1 while alive.
                    state, over = cartpole_step(tf, state, action)
                    alive = alive & ~over
                rewards = alive_at.stack()  # [MAX_STEPS, envs]
                reward_to_go = tf.scan(lambda later, r: r + gamma * later, rewards, reverse=True,
                                       initializer=tf.zeros([envs]))
                return {"states": states.stack(), "actions": actions.stack(), "reward_to_go": reward_to_go,
                        "mask": rewards, "returns": tf.reduce_sum(rewards, axis=0)}

            @tf.function
            def learn(states, actions, reward_to_go, mask):
                """Learner, on the coordinator: one REINFORCE update of the policy on the ps."""
                count = tf.reduce_sum(mask)
                mean = tf.reduce_sum(reward_to_go * mask) / count
                std = tf.sqrt(tf.reduce_sum((reward_to_go - mean) ** 2 * mask) / count) + 1e-6
                advantage = tf.reshape((reward_to_go - mean) / std * mask, [-1])
                with tf.GradientTape() as tape:
                    logits = policy(tf.reshape(states, [-1, 4]))
                    log_prob = -tf.nn.sparse_softmax_cross_entropy_with_logits(tf.reshape(actions, [-1]), logits)
                    loss = -tf.reduce_sum(log_prob * advantage) / count
                grads = tape.gradient(loss, policy.trainable_variables)
                optimizer.apply_gradients(zip(grads, policy.trainable_variables))
                return loss

            seeds = iter(range(10**9))

            def launch(version):
                seed = tf.constant([args.seed, next(seeds)], tf.int64)
                future = strategy.schedule(collect, args=(seed,))
                future.version = version  # Updates the learner had made when this collect started.
                return future

            start = time.monotonic()
            returns: list[float] = []
            lags: list[int] = []
            updates = collected_steps = 0
            pending = {launch(0) for _ in range(args.workers)}  # One collect in flight per worker.
            mean_return = 0.0
            while updates < args.max_updates and not (len(returns) >= SOLVED_WINDOW and mean_return >= args.target):
                done, pending = psclient.wait(pending, return_when=psclient.FIRST_COMPLETED)
                for future in done:
                    batch = future.result()
                    pending.add(launch(updates))  # Before learning: keep the actor busy.
                    learn(batch["states"], batch["actions"], batch["reward_to_go"], batch["mask"])
                    lags.append(updates - future.version)
                    updates += 1
                    returns.extend(batch["returns"].tolist())
                    collected_steps += int(batch["mask"].sum())
                    mean_return = float(np.mean(returns[-SOLVED_WINDOW:]))
                    if updates % 10 == 0:
                        print(f"update {updates:4d}  episodes {len(returns):5d}  mean return (last "
                              f"{SOLVED_WINDOW}) {mean_return:6.1f}  ({time.monotonic() - start:.1f} s)", flush=True)
            elapsed = time.monotonic() - start
            for future in pending:
                future.cancel()
            strategy.join()
            reached = len(returns) >= SOLVED_WINDOW and mean_return >= args.target
            summary = {
                "target_return": args.target, "window_episodes": SOLVED_WINDOW, "reached": reached,
                "mean_return": round(mean_return, 2), "updates": updates, "episodes": len(returns),
                "seconds": round(elapsed, 2), "env_steps": collected_steps,
                "env_steps_per_s": round(collected_steps / elapsed, 1),
                "updates_per_s": round(updates / elapsed, 2),
                "policy_lag_mean": round(float(np.mean(lags)), 2) if lags else None,
                "policy_lag_max": max(lags) if lags else None,
                "collects_per_worker": [w["done"] for w in strategy.stats()["workers"]],
            }
            print(f"{'reached' if reached else 'NOT reached'}: mean return {mean_return:.1f} over the last "
                  f"{SOLVED_WINDOW} episodes (target {args.target:g}) after {updates} updates, "
                  f"{len(returns)} episodes, {elapsed:.1f} s")
            print(f"throughput: {summary['env_steps_per_s']:.0f} environment steps/s (of live episodes), "
                  f"{summary['updates_per_s']:.1f} updates/s; policy lag mean {summary['policy_lag_mean']} "
                  f"max {summary['policy_lag_max']} updates; collects per worker {summary['collects_per_worker']}")
            if args.json:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump(summary, f, indent=2)
        finally:
            strategy.shutdown()
    return 0 if reached else 1


if __name__ == "__main__":
    sys.exit(main())
