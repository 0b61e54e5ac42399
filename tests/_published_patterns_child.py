"""A Keras script as published examples write it, run by tests/keras/test_published_patterns.py in a fresh process.

Data and preprocessing come first (a CSV read by a relative path, a tf.data pipeline,
a `StringLookup` applied in the pipeline, a `Normalization` adapted outside any scope;
images read from a directory by a relative path and augmented in the pipeline by random
layers, as keras.io's image classification example does),
trained with local Keras; only then is the strategy created (which connects this process
to the cluster) and the same model built in its scope, trained, validated, evaluated, used
for prediction and saved. Prints one JSON line of results.

usage: python _published_patterns_child.py CLUSTER_JSON   (run in the directory of the CSVs)
"""

import json
import os
import sys
import warnings

import numpy as np
import tensorflow as tf
import keras

import psclient

EPOCHS = 8
BATCH = 32
FEATURES = ["num1", "num2"]


def csv_dataset(name, shuffle=False):
    # Relative path, finite data of unknown size: as the structured-data examples read it.
    return tf.data.experimental.make_csv_dataset(
        name, batch_size=BATCH, label_name="target", num_epochs=1, shuffle=shuffle)


def build_model(normalizer, vocabulary_size):
    numbers = keras.Input((len(FEATURES),), name="numbers")
    category = keras.Input((), dtype="int64", name="category")
    encoded = keras.layers.CategoryEncoding(vocabulary_size, output_mode="one_hot")(category)
    x = keras.layers.Concatenate()([normalizer(numbers), encoded])
    x = keras.layers.Dense(16, activation="relu")(x)
    output = keras.layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model({"numbers": numbers, "category": category}, output)
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="binary_crossentropy", metrics=["accuracy"])
    return model


def image_pipeline():
    """keras.io's "image classification from scratch" input: images read from class folders, then
    `data_augmentation(images)` in the dataset's map (random layers: their seed generators' state
    variables are made here, before the strategy connects this process)."""
    rng = np.random.default_rng(3)
    for label, scale in (("dark", 100), ("light", 255)):
        os.makedirs(os.path.join("images", label), exist_ok=True)
        for i in range(16):
            pixels = (rng.random((12, 12, 3)) * scale).astype("uint8")
            keras.utils.save_img(os.path.join("images", label, f"{i}.png"), pixels)
    images = keras.utils.image_dataset_from_directory("images", image_size=(12, 12), batch_size=8, seed=1)
    data_augmentation = keras.Sequential([keras.layers.RandomFlip("horizontal"), keras.layers.RandomRotation(0.1)])
    return images.map(lambda x, y: (data_augmentation(x), y), num_parallel_calls=tf.data.AUTOTUNE)


def image_model():
    inputs = keras.Input((12, 12, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu")(keras.layers.Rescaling(1.0 / 255)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(x)))
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def main():
    jobs = json.loads(sys.argv[1])
    keras.utils.set_random_seed(7)

    # --- data and preprocessing first, as the examples do ---
    train_raw, val_raw, test_raw = csv_dataset("train.csv"), csv_dataset("val.csv"), csv_dataset("test.csv")
    lookup = keras.layers.StringLookup()  # a lookup table, adapted outside any scope
    lookup.adapt(train_raw.map(lambda features, _: features["cat"]))
    normalizer = keras.layers.Normalization()  # adapted outside the scope, used inside the model
    normalizer.adapt(train_raw.map(lambda features, _: tf.stack([features[f] for f in FEATURES], axis=1)))

    def prepare(features, target):
        numbers = tf.stack([tf.cast(features[f], tf.float32) for f in FEATURES], axis=1)
        return {"numbers": numbers, "category": lookup(features["cat"])}, target

    train, val, test = (d.map(prepare) for d in (train_raw, val_raw, test_raw))
    augmented = image_pipeline()
    results = {}

    # --- local Keras, the reference ---
    local = build_model(normalizer, lookup.vocabulary_size())
    history = local.fit(train, validation_data=val, epochs=EPOCHS, verbose=0)
    results["local"] = {
        "val_accuracy": history.history["val_accuracy"][-1],
        "evaluate": local.evaluate(test, verbose=0, return_dict=True),
        "n_predictions": int(local.predict(test, verbose=0).shape[0]),
    }
    results["local"]["batch_category_sums"] = [
        int(tf.reduce_sum(features["category"])) for features, _ in train.take(2)]

    # --- then the strategy, and the same script on the cluster ---
    strategy = psclient.ParameterServerStrategy(psclient.Cluster.from_dict(jobs))
    try:
        with strategy.scope():
            model = build_model(normalizer, lookup.vocabulary_size())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(train, validation_data=val, epochs=EPOCHS, verbose=0)
            model.fit(train, epochs=1, verbose=0)  # the warning is given once per model
        moved = [str(w.message) for w in caught if "created outside strategy.scope()" in str(w.message)]
        evaluated = model.evaluate(test, verbose=0, return_dict=True)
        predicted = model.predict(test, verbose=0)
        model.save("model.keras")
        loaded = keras.models.load_model("model.keras")  # outside the scope: a local model
        results["cluster"] = {
            "val_accuracy": history.history["val_accuracy"][-1],
            "evaluate": evaluated,
            "n_predictions": int(predicted.shape[0]),
            "moved_warnings": moved,
            "weights_on_ps": all("/job:ps" in v._value.device for v in model.variables),
            "loaded_evaluate": loaded.evaluate(test, verbose=0, return_dict=True),
            "max_prediction_difference": float(np.max(np.abs(loaded.predict(test, verbose=0) - predicted))),
        }

        # A model compiled again outside the scope once trained (a new optimizer and metrics, made here).
        model.compile(optimizer=keras.optimizers.Adam(0.001), loss="binary_crossentropy", metrics=["accuracy"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            recompiled = model.evaluate(test, verbose=0, return_dict=True)
            model.fit(train, epochs=1, verbose=0)
        state = model.variables + model.optimizer.variables + model.metrics_variables
        results["recompiled"] = {
            "evaluate": recompiled,
            "warnings": [str(w.message) for w in caught if "created outside strategy.scope()" in str(w.message)],
            "state_on_ps": all("/job:ps" in v._value.device for v in state),
        }

        # schedule() on a dataset made before the strategy (its lookup table included).
        iterator = iter(strategy.experimental_distribute_dataset(train.repeat()))

        @tf.function
        def category_sum(iterator):
            return tf.reduce_sum(next(iterator)[0]["category"])

        sums = [strategy.schedule(category_sum, args=(iterator,)) for _ in range(2)]
        strategy.join()
        results["schedule_batch_category_sums"] = [int(np.asarray(f.result())) for f in sums]

        # The augmented images, their pipeline made before the strategy.
        try:
            with strategy.scope():
                images_model = image_model()
            history = images_model.fit(augmented, epochs=2, verbose=0)
            results["augmented"] = {"loss": history.history["loss"],
                                    "evaluate": images_model.evaluate(augmented, verbose=0, return_dict=True)}
        except ValueError as error:  # reported by its own test, the other results kept
            results["augmented"] = {"error": str(error)}
    finally:
        strategy.shutdown()
    results["cwd"] = os.getcwd()
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
