"""keras.io examples as published, run by tests/keras/test_published_examples.py in a fresh process.

Each is the example's own code on small offline data (its structure, calls and order kept):
the data and preprocessing are built first, the model is trained with local Keras, and only
then is the strategy created (which connects this process to the cluster) and the same
example run again, its model built in the strategy's scope:

- text classification from scratch: `text_dataset_from_directory`, a `TextVectorization`
  adapted on the dataset and mapped over it, then an end-to-end model taking raw strings;
- structured data with `FeatureSpace` (lookups, discretization, normalization, crosses),
  adapted before, mapped in the pipeline, then an inference model on a dict of raw values;
- weather-style forecasting: `timeseries_dataset_from_array`, an LSTM, `EarlyStopping` and a
  weights-only `ModelCheckpoint` of the best epoch, loaded back;
- a VAE: a subclassed model with its own `train_step` and metric trackers, a sampling layer
  with its own `SeedGenerator`;
- knowledge distillation: a teacher fit first, then a `Distiller` overriding `compile` and
  `compute_loss`;
- the functional API guide's multi-input, multi-output model, losses and weights by name;
- transfer learning: a frozen base, then unfrozen and the model compiled again after training
  (outside any scope, as the guide does) and fit again;
- the callbacks guide's `EarlyStoppingAtMinLoss`: `get_weights` at each better epoch,
  `stop_training` and `set_weights` back to the best;
- a layer adding an activity loss (`add_loss`) in a model with its own `test_step`.

Prints one JSON line of results.

usage: python _published_examples_child.py CLUSTER_JSON WORK_DIR
"""

import os
import re
import string
import sys

import numpy as np
import tensorflow as tf
import keras
from keras import layers, ops

import psclient  # noqa: F401  (imported before the examples, as the scripts do)
from _published_runs import digits_data, run_locally_then_on_the_cluster


def text_data(root, rng):
    """Two folders of short reviews per split, as aclImdb's layout: the words tell the label."""
    positive, negative = ["great", "wonderful", "loved", "superb"], ["awful", "boring", "hated", "dull"]
    filler = ["the", "movie", "was", "and", "plot", "actor", "a", "it", "<br />", "film"]
    for split, count in (("train", 160), ("test", 60)):
        for label, words in (("pos", positive), ("neg", negative)):
            folder = os.path.join(root, "aclImdb", split, label)
            os.makedirs(folder)
            for i in range(count):
                text = " ".join(rng.choice(filler + words, size=int(rng.integers(15, 40))))
                with open(os.path.join(folder, f"{i}.txt"), "w") as file:
                    file.write(text + ".")
    train = os.path.join(root, "aclImdb", "train")
    raw_train_ds = keras.utils.text_dataset_from_directory(train, batch_size=32, validation_split=0.2,
                                                           subset="training", seed=1337, verbose=False)
    raw_val_ds = keras.utils.text_dataset_from_directory(train, batch_size=32, validation_split=0.2,
                                                         subset="validation", seed=1337, verbose=False)
    raw_test_ds = keras.utils.text_dataset_from_directory(os.path.join(root, "aclImdb", "test"), batch_size=32,
                                                          verbose=False)

    def custom_standardization(input_data):
        lowercase = tf.strings.lower(input_data)
        stripped_html = tf.strings.regex_replace(lowercase, "<br />", " ")
        return tf.strings.regex_replace(stripped_html, f"[{re.escape(string.punctuation)}]", "")

    vectorize_layer = keras.layers.TextVectorization(standardize=custom_standardization, max_tokens=500,
                                                     output_mode="int", output_sequence_length=40)
    vectorize_layer.adapt(raw_train_ds.map(lambda x, y: x))

    def vectorize_text(text, label):
        return vectorize_layer(tf.expand_dims(text, -1)), label

    train_ds, val_ds, test_ds = (d.map(vectorize_text).cache().prefetch(buffer_size=10)
                                 for d in (raw_train_ds, raw_val_ds, raw_test_ds))
    return vectorize_layer, train_ds, val_ds, test_ds, raw_test_ds


def text_example(data):
    vectorize_layer, train_ds, val_ds, test_ds, raw_test_ds = data
    inputs = keras.Input(shape=(None,), dtype="int64")
    x = layers.Embedding(500, 16)(inputs)
    x = layers.Dropout(0.5)(x)
    x = layers.Conv1D(32, 7, padding="valid", activation="relu", strides=3)(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(32, activation="relu")(x)
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = keras.Model(inputs, predictions)
    model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model, lambda: model.fit(train_ds, validation_data=val_ds, epochs=6, verbose=0), \
        lambda: _text_end_to_end(model, vectorize_layer, test_ds, raw_test_ds)


def _text_end_to_end(model, vectorize_layer, test_ds, raw_test_ds):
    # The example's end-to-end model, made and compiled after training, outside any scope.
    inputs = keras.Input(shape=(1,), dtype="string")
    end_to_end_model = keras.Model(inputs, model(vectorize_layer(inputs)))
    end_to_end_model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    return {"evaluate": model.evaluate(test_ds, verbose=0, return_dict=True),
            "end_to_end": end_to_end_model.evaluate(raw_test_ds, verbose=0, return_dict=True)}


def feature_space_data(rng):
    n = 600
    columns = {
        "age": rng.integers(29, 77, n), "sex": rng.integers(0, 2, n), "cp": rng.integers(0, 5, n),
        "trestbps": rng.normal(130, 17, n).round(), "chol": rng.normal(246, 50, n).round(),
        "thal": rng.choice(["fixed", "normal", "reversible"], n), "oldpeak": rng.normal(1, 1.1, n).round(1),
    }
    target = ((columns["thal"] == "reversible") | (columns["chol"] > 270)).astype("int64")
    cut = 480

    def dataframe_to_dataset(lo, hi, seed):
        features = {name: values[lo:hi] for name, values in columns.items()}
        return tf.data.Dataset.from_tensor_slices((features, target[lo:hi])).shuffle(buffer_size=hi - lo, seed=seed)

    train_ds, val_ds = dataframe_to_dataset(0, cut, 1).batch(32), dataframe_to_dataset(cut, n, 2).batch(32)
    FeatureSpace = keras.utils.FeatureSpace
    feature_space = FeatureSpace(
        features={
            "sex": FeatureSpace.integer_categorical(num_oov_indices=0),
            "cp": FeatureSpace.integer_categorical(num_oov_indices=0),
            "thal": FeatureSpace.string_categorical(num_oov_indices=0),
            "age": FeatureSpace.integer_categorical(num_oov_indices=0),
            "trestbps": FeatureSpace.float_discretized(num_bins=10),
            "chol": FeatureSpace.float_normalized(),
            "oldpeak": FeatureSpace.float_normalized(),
        },
        crosses=[FeatureSpace.cross(feature_names=("sex", "age"), crossing_dim=64),
                 FeatureSpace.cross(feature_names=("thal", "cp"), crossing_dim=16)],
        output_mode="concat",
    )
    feature_space.adapt(train_ds.map(lambda x, _: x))
    preprocessed_train_ds = train_ds.map(lambda x, y: (feature_space(x), y), num_parallel_calls=tf.data.AUTOTUNE)
    preprocessed_val_ds = val_ds.map(lambda x, y: (feature_space(x), y), num_parallel_calls=tf.data.AUTOTUNE)
    return feature_space, preprocessed_train_ds.prefetch(tf.data.AUTOTUNE), preprocessed_val_ds.prefetch(tf.data.AUTOTUNE)


def feature_space_example(data):
    feature_space, train_ds, val_ds = data
    dict_inputs = feature_space.get_inputs()
    encoded_features = feature_space.get_encoded_features()
    x = layers.Dense(32, activation="relu")(encoded_features)
    x = layers.Dropout(0.5)(x)
    predictions = layers.Dense(1, activation="sigmoid")(x)
    training_model = keras.Model(inputs=encoded_features, outputs=predictions)
    training_model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    inference_model = keras.Model(inputs=dict_inputs, outputs=predictions)

    def use():
        sample = {"age": 60, "sex": 1, "cp": 1, "trestbps": 145.0, "chol": 233.0, "thal": "reversible",
                  "oldpeak": 2.3}
        input_dict = {name: ops.convert_to_tensor([value]) for name, value in sample.items()}
        return {"evaluate": training_model.evaluate(val_ds, verbose=0, return_dict=True),
                "inference": float(inference_model.predict(input_dict, verbose=0)[0][0])}

    return training_model, lambda: training_model.fit(train_ds, epochs=8, validation_data=val_ds, verbose=0), use


def forecast_data(rng):
    t = np.arange(2400, dtype="float32")
    series = np.stack([np.sin(t / 20), np.cos(t / 33), rng.normal(0, 0.1, t.size)], 1).astype("float32")
    past, future, split = 48, 12, 1600
    train = keras.utils.timeseries_dataset_from_array(
        series[:split], series[past + future:split + past + future, 0], sequence_length=past, sampling_rate=2,
        batch_size=64)
    val = keras.utils.timeseries_dataset_from_array(
        series[split:-(past + future)], series[split + past + future:, 0], sequence_length=past, sampling_rate=2,
        batch_size=64)
    return past, train, val


def forecast_example(data, path):
    past, dataset_train, dataset_val = data
    inputs = keras.layers.Input(shape=(past // 2, 3))
    outputs = keras.layers.Dense(1)(keras.layers.LSTM(16)(inputs))
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.005), loss="mse")
    callbacks = [keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=5),
                 keras.callbacks.ModelCheckpoint(monitor="val_loss", filepath=path, verbose=0,
                                                 save_weights_only=True, save_best_only=True)]

    def use():
        best = min(history_holder[0].history["val_loss"])
        model.load_weights(path)
        return {"best_val_loss": best, "loaded_val_loss": float(model.evaluate(dataset_val, verbose=0))}

    history_holder = []

    def fit():
        history_holder.append(model.fit(dataset_train, epochs=6, validation_data=dataset_val, callbacks=callbacks,
                                        verbose=0))
        return history_holder[0]

    return model, fit, use


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch, dim = ops.shape(z_mean)[0], ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder, self.decoder = encoder, decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


def vae_example(digits):
    latent_dim = 2
    encoder_inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Conv2D(16, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Dense(16, activation="relu")(layers.Flatten()(x))
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])], name="encoder")
    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Reshape((4, 4, 16))(layers.Dense(4 * 4 * 16, activation="relu")(latent_inputs))
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", strides=2, padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    vae = VAE(encoder, decoder)
    vae.compile(optimizer=keras.optimizers.Adam())

    def use():
        z_mean, _, _ = vae.encoder.predict(digits[:64], verbose=0)
        return {"z_mean_finite": bool(np.isfinite(z_mean).all())}

    return vae, lambda: vae.fit(digits, epochs=6, batch_size=64, verbose=0), use


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher, self.student = teacher, student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
        self.alpha, self.temperature = alpha, temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def distillation_example(digits, labels):
    teacher = keras.Sequential([keras.Input((8, 8, 1)), layers.Conv2D(32, 3, padding="same"), layers.LeakyReLU(0.2),
                                layers.Flatten(), layers.Dense(10)], name="teacher")
    student = keras.Sequential([keras.Input((8, 8, 1)), layers.Flatten(), layers.Dense(10)], name="student")
    teacher.compile(optimizer=keras.optimizers.Adam(), metrics=[keras.metrics.SparseCategoricalAccuracy()],
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    distiller = Distiller(student=student, teacher=teacher)
    distiller.compile(optimizer=keras.optimizers.Adam(), metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)

    def fit():
        teacher.fit(digits[:1400], labels[:1400], epochs=8, verbose=0)
        return distiller.fit(digits[:1400], labels[:1400], epochs=5, verbose=0)

    def use():
        return {"teacher": teacher.evaluate(digits[1400:], labels[1400:], verbose=0, return_dict=True),
                "student": distiller.evaluate(digits[1400:], labels[1400:], verbose=0, return_dict=True)}

    return distiller, fit, use


def multi_io_example(rng):
    num_tags, num_words, num_departments = 12, 1000, 4
    inputs = {"title": rng.integers(num_words, size=(640, 10)), "body": rng.integers(num_words, size=(640, 50)),
              "tags": rng.integers(2, size=(640, num_tags)).astype("float32")}
    targets = {"priority": rng.random(size=(640, 1)).astype("float32"),
               "department": rng.integers(2, size=(640, num_departments)).astype("float32")}
    title_input = keras.Input(shape=(None,), name="title")
    body_input = keras.Input(shape=(None,), name="body")
    tags_input = keras.Input(shape=(num_tags,), name="tags")
    title_features = layers.LSTM(16)(layers.Embedding(num_words, 16)(title_input))
    body_features = layers.LSTM(8)(layers.Embedding(num_words, 16)(body_input))
    x = layers.concatenate([title_features, body_features, tags_input])
    model = keras.Model(inputs=[title_input, body_input, tags_input],
                        outputs={"priority": layers.Dense(1, name="priority")(x),
                                 "department": layers.Dense(num_departments, name="department")(x)})
    model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
                  loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
                        "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
                  loss_weights={"priority": 1.0, "department": 0.2})
    return model, lambda: model.fit(inputs, targets, epochs=2, batch_size=32, verbose=0), \
        lambda: {"evaluate": model.evaluate(inputs, targets, verbose=0, return_dict=True)}


def transfer_example(digits, labels):
    base_model = keras.Sequential([keras.Input((8, 8, 1)), layers.Conv2D(16, 3, activation="relu"), layers.Flatten()],
                                  name="base")
    base_model.trainable = False
    inputs = keras.Input(shape=(8, 8, 1))
    x = base_model(inputs, training=False)
    outputs = keras.layers.Dense(10)(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(), metrics=[keras.metrics.SparseCategoricalAccuracy()],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    frozen = []

    def fit():
        model.fit(digits[:1400], labels[:1400], epochs=3, verbose=0)
        frozen.append(len(model.trainable_weights))
        base_model.trainable = True  # fine-tuning: unfrozen, compiled again, a low learning rate
        model.compile(optimizer=keras.optimizers.Adam(1e-4), metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(digits[:1400], labels[:1400], epochs=2, verbose=0)

    def use():
        return {"evaluate": model.evaluate(digits[1400:], labels[1400:], verbose=0, return_dict=True),
                "trainable_frozen": frozen[0], "trainable_unfrozen": len(model.trainable_weights)}

    return model, fit, use


class EarlyStoppingAtMinLoss(keras.callbacks.Callback):
    """Stop training when the loss is at its min, i.e. the loss stops decreasing."""

    def __init__(self, patience=0):
        super().__init__()
        self.patience = patience
        self.best_weights = None

    def on_train_begin(self, logs=None):
        self.wait, self.stopped_epoch, self.best = 0, 0, np.inf

    def on_epoch_end(self, epoch, logs=None):
        current = logs.get("loss")
        if np.less(current, self.best):
            self.best, self.wait = current, 0
            self.best_weights = self.model.get_weights()
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stopped_epoch = epoch
                self.model.stop_training = True
                self.model.set_weights(self.best_weights)


def min_loss_example(rng):
    x = rng.normal(size=(1000, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + rng.normal(0, 0.1, size=(1000, 1))).astype("float32")
    model = keras.Sequential([keras.Input((8,)), layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mean_squared_error",
                  metrics=["mean_absolute_error"])
    callback = EarlyStoppingAtMinLoss(patience=1)

    def use():
        return {"stopped_epoch": callback.stopped_epoch, "best": float(callback.best),
                "loss_now": float(model.evaluate(x, y, verbose=0)[0])}

    return model, lambda: model.fit(x, y, batch_size=64, epochs=30, verbose=0, callbacks=[callback]), use


class ActivityRegularizationLayer(layers.Layer):
    def call(self, inputs):
        self.add_loss(1e-3 * ops.mean(ops.square(inputs)))
        return inputs


class CustomModel(keras.Model):
    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def add_loss_example(features, labels):
    inputs = keras.Input(shape=(64,))
    x = ActivityRegularizationLayer()(layers.Dense(32, activation="relu")(inputs))
    model = CustomModel(inputs, layers.Dense(10)(x))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    fit = lambda: model.fit(features[:1400], labels[:1400], epochs=4, verbose=0,  # noqa: E731
                            validation_data=(features[1400:], labels[1400:]))
    return model, fit, lambda: {"evaluate": model.evaluate(features[1400:], labels[1400:], verbose=0,
                                                           return_dict=True)}


def examples_of(tag, data, work):
    """name -> a maker of (model, fit, use) for this module's examples."""
    return {
        "text": lambda: text_example(data["text"]),
        "feature_space": lambda: feature_space_example(data["feature_space"]),
        "forecast": lambda: forecast_example(data["forecast"], os.path.join(work, f"best_{tag}.weights.h5")),
        "vae": lambda: vae_example(data["digits"]),
        "distillation": lambda: distillation_example(data["digits"], data["labels"]),
        "multi_io": lambda: multi_io_example(np.random.default_rng(9)),
        "transfer": lambda: transfer_example(data["digits"], data["labels"]),
        "min_loss": lambda: min_loss_example(np.random.default_rng(5)),
        "add_loss": lambda: add_loss_example(data["features"], data["labels"]),
    }


def main():
    work = sys.argv[2]
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(3)
    # The data and preprocessing first, as the examples do.
    data = {"text": text_data(work, rng), "feature_space": feature_space_data(rng), "forecast": forecast_data(rng),
            **digits_data()}
    run_locally_then_on_the_cluster(examples_of, data)


if __name__ == "__main__":
    main()
