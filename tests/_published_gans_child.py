"""keras.io examples with more than one optimizer or a model called from a callback, as published,
run by tests/keras/test_published_examples.py in a fresh process (see _published_examples_child.py):

- "DCGAN to generate face images": a `GAN` model overriding `compile` with two optimizers and a
  loss function, its own `train_step` applying each optimizer to its own model, random latent
  vectors from its own `SeedGenerator`, noisy labels;
- "WGAN-GP": the same with a gradient penalty (a `GradientTape` inside the discriminator's tape),
  `training=True` calls, Adam with `beta_1=0.5, beta_2=0.9`;
- "Text generation with a miniature GPT": a token-and-position embedding layer, a causal
  Transformer block, two outputs (the second without a loss), and a callback that generates
  tokens at each epoch's end with `model.predict`, one call per token.

Data: scikit-learn's bundled digits (offline) and seeded random token sequences.
"""

import numpy as np
import tensorflow as tf
import keras
from keras import layers, ops

import psclient  # noqa: F401  (imported before the examples, as the scripts do)
from _published_runs import digits_data, run_locally_then_on_the_cluster

LATENT_DIM = 16


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * tf.random.uniform(tf.shape(labels))  # noise on the labels, as published
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined_images))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = ops.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(misleading_labels, self.discriminator(self.generator(random_latent_vectors)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


class WGAN(GAN):
    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            fake_images = self.generator(random_latent_vectors, training=True)
            fake_logits = self.discriminator(fake_images, training=True)
            real_logits = self.discriminator(real_images, training=True)
            d_cost = tf.reduce_mean(fake_logits) - tf.reduce_mean(real_logits)
            alpha = tf.random.uniform([batch_size, 1, 1, 1], 0.0, 1.0)
            interpolated = real_images + alpha * (fake_images - real_images)
            with tf.GradientTape() as gp_tape:
                gp_tape.watch(interpolated)
                pred = self.discriminator(interpolated, training=True)
            grads = gp_tape.gradient(pred, [interpolated])[0]
            norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
            d_loss = d_cost + 10.0 * tf.reduce_mean((norm - 1.0) ** 2)
        d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
        self.d_optimizer.apply_gradients(zip(d_gradient, self.discriminator.trainable_variables))
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            generated_images = self.generator(random_latent_vectors, training=True)
            g_loss = -tf.reduce_mean(self.discriminator(generated_images, training=True))
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def discriminator_and_generator():
    discriminator = keras.Sequential([
        keras.Input(shape=(8, 8, 1)),
        layers.Conv2D(16, kernel_size=3, strides=2, padding="same"), layers.LeakyReLU(negative_slope=0.2),
        layers.Flatten(), layers.Dropout(0.2), layers.Dense(1, activation="sigmoid"),
    ], name="discriminator")
    generator = keras.Sequential([
        keras.Input(shape=(LATENT_DIM,)),
        layers.Dense(4 * 4 * 16), layers.Reshape((4, 4, 16)),
        layers.Conv2DTranspose(16, kernel_size=4, strides=2, padding="same"), layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(1, kernel_size=3, padding="same", activation="sigmoid"),
    ], name="generator")
    return discriminator, generator


def generated_summary(gan):
    """What the trained GAN gives, and where its two optimizers' state is (each its own model's)."""
    images = gan.generator.predict(np.random.default_rng(0).normal(size=(16, LATENT_DIM)).astype("float32"), verbose=0)
    optimizers = (gan.d_optimizer, gan.g_optimizer)
    return {"generated_shape": list(images.shape), "generated_finite": bool(np.isfinite(images).all()),
            "iterations": [int(optimizer.iterations.numpy()) for optimizer in optimizers],
            "optimizer_state_on_ps": all("/job:ps" in v._value.device for o in optimizers for v in o.variables)}


def gan_example(digits):
    gan = GAN(*discriminator_and_generator(), latent_dim=LATENT_DIM)
    gan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0001),
                g_optimizer=keras.optimizers.Adam(learning_rate=0.0001),
                loss_fn=keras.losses.BinaryCrossentropy())
    dataset = tf.data.Dataset.from_tensor_slices(digits[:640]).batch(32)  # 20 steps an epoch: the suite's time
    return gan, lambda: gan.fit(dataset, epochs=2, verbose=0), lambda: generated_summary(gan)


def wgan_example(digits):
    wgan = WGAN(*discriminator_and_generator(), latent_dim=LATENT_DIM)
    wgan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
                 g_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
                 loss_fn=None)
    return wgan, lambda: wgan.fit(digits[:640], batch_size=64, epochs=2, verbose=0), lambda: generated_summary(wgan)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        return self.token_emb(x) + self.pos_emb(ops.arange(0, maxlen, 1))


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads, embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attention_output = self.dropout1(self.att(inputs, inputs, use_causal_mask=True))
        out1 = self.layernorm1(inputs + attention_output)
        return self.layernorm2(out1 + self.dropout2(self.ffn(out1)))


class TextGenerator(keras.callbacks.Callback):
    """Generates `max_tokens` tokens after `start_tokens` at each epoch's end (greedy, one predict a token)."""

    def __init__(self, max_tokens, start_tokens, maxlen):
        super().__init__()
        self.max_tokens, self.start_tokens, self.maxlen = max_tokens, list(start_tokens), maxlen
        self.generated = []

    def on_epoch_end(self, epoch, logs=None):
        tokens = list(self.start_tokens)
        for _ in range(self.max_tokens):
            pad_len = self.maxlen - len(tokens)
            x = np.array([tokens + [0] * pad_len])
            y, _ = self.model.predict(x, verbose=0)
            tokens.append(int(np.argmax(y[0][len(tokens) - 1])))
        self.generated.append(tokens)


def gpt_example():
    maxlen, vocab_size, embed_dim = 16, 40, 32
    # Sequences that count up modulo the vocabulary from a random start: the next token is learnable.
    starts = np.random.default_rng(11).integers(1, vocab_size, 768)
    sequences = (starts[:, None] + np.arange(maxlen + 1)[None, :]) % (vocab_size - 1) + 1
    dataset = tf.data.Dataset.from_tensor_slices((sequences[:, :-1], sequences[:, 1:])).shuffle(256, seed=1).batch(32)
    inputs = layers.Input(shape=(maxlen,), dtype="int32")
    x = TransformerBlock(embed_dim, 2, embed_dim)(TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs))
    outputs = layers.Dense(vocab_size)(x)
    model = keras.Model(inputs=inputs, outputs=[outputs, x])
    model.compile("adam", loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), None])
    generator = TextGenerator(6, [5, 6, 7], maxlen)
    fit = lambda: model.fit(dataset, epochs=2, verbose=0, callbacks=[generator])  # noqa: E731
    return model, fit, lambda: {"generated": generator.generated}


def examples_of(tag, data, work):
    return {
        "gan": lambda: gan_example(data["digits"]),
        "wgan_gp": lambda: wgan_example(data["digits"]),
        "gpt": gpt_example,
    }


if __name__ == "__main__":
    keras.utils.set_random_seed(3)
    run_locally_then_on_the_cluster(examples_of, digits_data())
