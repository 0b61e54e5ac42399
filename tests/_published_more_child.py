"""More keras.io patterns as published, run by tests/keras/test_published_more.py in a fresh process.

Each is a published example's own code, shrunk to small offline data (scikit-learn's digits or
seeded token sequences): the data built first, the model trained with local Keras, then the
strategy created and the same code run again, its model built in the strategy's scope:

- text classification with a Transformer: custom `TransformerBlock` (`MultiHeadAttention`) and
  `TokenAndPositionEmbedding` layers (`ops.arange` positions);
- a bidirectional LSTM over token ids;
- the fault-tolerance guide's `BackupAndRestore`: a `fit` interrupted at epoch 2 by a callback that
  raises, then the same `fit` again, which resumes at the epoch it stopped in;
- `LearningRateScheduler` beside `TensorBoard(histogram_freq=1)` with `validation_split`;
- a `keras.utils.PyDataset` subclass given to `fit`, `evaluate` and `predict`;
- augmentation layers inside the model (`RandomFlip`, `RandomRotation`: their seed state trained
  on the workers) on a `tf.data` pipeline;
- "writing a training loop from scratch": a `tf.function` train step called from the script's own
  loop (a `GradientTape`, `optimizer.apply`, a metric's `update_state`), not `fit`;
- mixed precision (`mixed_float16`: `compile` wraps the optimizer in a `LossScaleOptimizer`);
- `compile(jit_compile=True, steps_per_execution=4)` with a repeated dataset, `steps_per_epoch`
  and `validation_steps`;
- a full-model `ModelCheckpoint(save_best_only=True)` to a `.keras` file with a custom `Metric`
  subclass, loaded back with `load_model(custom_objects=...)`.

Prints one JSON line of results.

usage: python _published_more_child.py CLUSTER_JSON WORK_DIR
"""

import os
import types

import numpy as np
import tensorflow as tf
import keras
from keras import layers, ops
import psclient  # noqa: F401  (imported before the examples, as the scripts do)
from _published_gans_child import TokenAndPositionEmbedding  # keras.io's, as its GPT example has it
from _published_runs import digits_data, run_locally_then_on_the_cluster


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


class InterruptingCallback(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("Interrupting!")


class DigitsSequence(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return int(np.ceil(len(self.x) / self.batch_size))

    def __getitem__(self, idx):
        lo = idx * self.batch_size
        hi = min(lo + self.batch_size, len(self.x))
        return self.x[lo:hi], self.y[lo:hi]


def examples_of(tag, data, work):
    x, y, feats = data["digits"], data["labels"], data["features"]
    rng = np.random.default_rng(0)
    seqs = rng.integers(1, 200, size=(1024, 24))
    seq_labels = (seqs == 7).any(axis=1).astype("int32")
    seqs[seq_labels == 1, 3] = 7

    def transformer():
        inputs = layers.Input(shape=(24,))
        e = TokenAndPositionEmbedding(24, 200, 16)(inputs)
        h = TransformerBlock(16, 2, 16)(e)
        h = layers.GlobalAveragePooling1D()(h)
        h = layers.Dropout(0.1)(h)
        h = layers.Dense(20, activation="relu")(h)
        out = layers.Dense(2, activation="softmax")(h)
        model = keras.Model(inputs=inputs, outputs=out)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model, lambda: model.fit(seqs[:800], seq_labels[:800], batch_size=32, epochs=3,
                                        validation_data=(seqs[800:], seq_labels[800:]), verbose=0), \
            lambda: {"evaluate": model.evaluate(seqs[800:], seq_labels[800:], verbose=0, return_dict=True)}

    def backup_and_restore():
        model = keras.Sequential([keras.Input((64,)), layers.Dense(32, activation="relu"), layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        backup = os.path.join(work, tag + "-backup")
        cb = keras.callbacks.BackupAndRestore(backup_dir=backup)
        interrupted = []
        def fit():
            try:
                model.fit(feats, y, epochs=5, batch_size=64, callbacks=[cb, InterruptingCallback()], verbose=0)
            except RuntimeError as e:
                interrupted.append(str(e))
            return model.fit(feats, y, epochs=5, batch_size=64, callbacks=[cb], verbose=0)
        return model, fit, lambda: {"interrupted": interrupted, "backup_left": os.path.exists(backup),
                                    "evaluate": model.evaluate(feats, y, verbose=0, return_dict=True)}

    def lr_and_tensorboard():
        model = keras.Sequential([keras.Input((64,)), layers.Dense(32, activation="relu"), layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        logdir = os.path.join(work, tag + "-tb")
        def fit():
            return model.fit(feats, y, epochs=3, batch_size=64, verbose=0, validation_split=0.2,
                             callbacks=[keras.callbacks.TensorBoard(logdir, histogram_freq=1),
                                        keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)])
        def use():
            files = []
            for root, _, names in os.walk(logdir):
                files += [os.path.relpath(os.path.join(root, n), logdir).split(".")[0] for n in names]
            return {"evaluate": model.evaluate(feats, y, verbose=0, return_dict=True), "event_files": sorted(set(files)),
                    "learning_rate": float(ops.convert_to_numpy(model.optimizer.learning_rate))}
        return model, fit, use

    def pydataset():
        model = keras.Sequential([keras.Input((64,)), layers.Dense(32, activation="relu"), layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        seq = DigitsSequence(feats, y, 64)
        return model, lambda: model.fit(seq, epochs=3, verbose=0, validation_data=DigitsSequence(feats[:200], y[:200], 50)), \
            lambda: {"evaluate": model.evaluate(seq, verbose=0, return_dict=True),
                     "predicted": model.predict(DigitsSequence(feats[:10], y[:10], 5), verbose=0).argmax(-1).tolist()}

    def bidirectional_lstm():
        inputs = keras.Input(shape=(None,), dtype="int32")
        h = layers.Embedding(200, 16)(inputs)
        h = layers.Bidirectional(layers.LSTM(8, return_sequences=True))(h)
        h = layers.Bidirectional(layers.LSTM(8))(h)
        out = layers.Dense(1, activation="sigmoid")(h)
        model = keras.Model(inputs, out)
        model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
        return model, lambda: model.fit(seqs[:800], seq_labels[:800], batch_size=32, epochs=2,
                                        validation_data=(seqs[800:], seq_labels[800:]), verbose=0), \
            lambda: {"evaluate": model.evaluate(seqs[800:], seq_labels[800:], verbose=0, return_dict=True)}

    def augmentation_in_model():
        data_augmentation = keras.Sequential([layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)])
        inputs = keras.Input(shape=(8, 8, 1))
        h = data_augmentation(inputs)
        h = layers.Rescaling(1.0)(h)
        h = layers.Conv2D(16, 3, activation="relu")(h)
        h = layers.Flatten()(h)
        out = layers.Dense(10)(h)
        model = keras.Model(inputs, out)
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["acc"])
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=1).batch(64).prefetch(tf.data.AUTOTUNE)
        return model, lambda: model.fit(ds, epochs=3, verbose=0), lambda: {"evaluate": model.evaluate(ds, verbose=0, return_dict=True)}

    def custom_loop():
        model = keras.Sequential([keras.Input((64,)), layers.Dense(32, activation="relu"), layers.Dense(10)])
        optimizer = keras.optimizers.SGD(learning_rate=1e-1)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        train_acc_metric = keras.metrics.SparseCategoricalAccuracy()
        train_dataset = tf.data.Dataset.from_tensor_slices((feats, y)).shuffle(1024, seed=2).batch(64)

        @tf.function
        def train_step(xb, yb):
            with tf.GradientTape() as tape:
                logits = model(xb, training=True)
                loss_value = loss_fn(yb, logits)
            grads = tape.gradient(loss_value, model.trainable_weights)
            optimizer.apply(grads, model.trainable_weights)
            train_acc_metric.update_state(yb, logits)
            return loss_value

        def fit():  # the guide's loop: epochs over the dataset, the metric read and reset after each
            history = {"acc": [], "loss": []}
            for epoch in range(3):
                for step, (xb, yb) in enumerate(train_dataset):
                    loss_value = train_step(xb, yb)
                history["acc"].append(float(train_acc_metric.result()))
                history["loss"].append(float(loss_value))
                train_acc_metric.reset_state()
            return types.SimpleNamespace(history=history)
        return model, fit, lambda: {"loss": float(ops.convert_to_numpy(loss_fn(y, model(feats)))),
                                  "iterations": int(ops.convert_to_numpy(optimizer.iterations))}

    def mixed_precision():
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            inputs = keras.Input((64,))
            h = layers.Dense(32, activation="relu")(inputs)
            h = layers.Dense(10)(h)
            out = layers.Activation("softmax", dtype="float32")(h)
            model = keras.Model(inputs, out)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        model.compile(optimizer=keras.optimizers.RMSprop(), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model, lambda: model.fit(feats, y, batch_size=64, epochs=3, verbose=0, validation_split=0.2), \
            lambda: {"evaluate": model.evaluate(feats, y, verbose=0, return_dict=True),
                     "optimizer": type(model.optimizer).__name__}

    def jit_and_spe():
        model = keras.Sequential([keras.Input((64,)), layers.Dense(32, activation="relu"), layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=True, steps_per_execution=4)
        ds = tf.data.Dataset.from_tensor_slices((feats, y)).shuffle(2000, seed=3).repeat().batch(32)
        return model, lambda: model.fit(ds, epochs=3, steps_per_epoch=20, validation_data=ds, validation_steps=5, verbose=0), \
            lambda: {"evaluate": model.evaluate(feats, y, verbose=0, return_dict=True)}

    def best_full_model_checkpoint():
        class Recall10(keras.metrics.Metric):
            def __init__(self, name="hits", **kw):
                super().__init__(name=name, **kw)
                self.hits = self.add_variable(shape=(), initializer="zeros", name="hits")
            def update_state(self, y_true, y_pred, sample_weight=None):
                pred = ops.argmax(y_pred, axis=-1)
                self.hits.assign_add(ops.sum(ops.cast(ops.equal(ops.cast(y_true, pred.dtype), pred), "float32")))
            def result(self):
                return self.hits
        model = keras.Sequential([keras.Input((64,)), layers.Dense(32, activation="relu"), layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[Recall10()])
        path = os.path.join(work, tag + "-best.keras")
        def fit():
            return model.fit(feats, y, epochs=4, batch_size=64, validation_split=0.25, verbose=0,
                             callbacks=[keras.callbacks.ModelCheckpoint(path, monitor="val_loss", save_best_only=True)])
        def use():
            loaded = keras.models.load_model(path, custom_objects={"Recall10": Recall10})
            return {"loaded": loaded.evaluate(feats, y, verbose=0, return_dict=True),
                    "model": model.evaluate(feats, y, verbose=0, return_dict=True)}
        return model, fit, use

    return {"transformer": transformer, "backup_and_restore": backup_and_restore,
            "lr_and_tensorboard": lr_and_tensorboard, "pydataset": pydataset,
            "bidirectional_lstm": bidirectional_lstm, "augmentation_in_model": augmentation_in_model,
            "custom_loop": custom_loop, "mixed_precision": mixed_precision,
            "jit_and_spe": jit_and_spe, "best_full_model_checkpoint": best_full_model_checkpoint}


if __name__ == "__main__":
    keras.utils.set_random_seed(0)
    run_locally_then_on_the_cluster(examples_of, digits_data())
