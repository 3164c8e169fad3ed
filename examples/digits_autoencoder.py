"""A convolutional autoencoder (flax.linen) on scikit-learn's 8x8 digits, with images in TensorBoard.

The encoder squeezes an 8x8 digit through two convolutions into a ``--latent-dim`` vector; the
decoder rebuilds it with a transposed convolution. The loss is the mean squared error per pixel
(pixels in [0, 1]). After every validation, the ``on_validation_epoch_end`` hook (the seed's
example of a hook) logs a grid of validation digits (top row) and their reconstructions (bottom
row) to TensorBoard with ``self.log_image``: watch them sharpen under TensorBoard's Images tab
(``tensorboard --logdir checkpoints``). The reported figure is the test reconstruction MSE, next
to the MSE of always predicting the mean training image.

Run: python examples/digits_autoencoder.py [--epochs 40] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import flaxlight
from digits_cnn import conv_kernel_init, load_splits

IMAGE_TAG = "val/reconstructions"


class ConvAutoencoder(nn.Module):
    """8x8x1 -> conv -> conv (stride 2) -> dense latent -> dense -> transposed conv -> conv -> sigmoid."""

    latent_dim: int = 16
    width: int = 16

    def setup(self):
        conv = dict(kernel_size=(3, 3), kernel_init=conv_kernel_init)
        self.encoder_convs = [nn.Conv(self.width, **conv), nn.Conv(2 * self.width, strides=2, **conv)]
        self.to_latent = nn.Dense(self.latent_dim)
        self.from_latent = nn.Dense(4 * 4 * 2 * self.width)
        self.upsample = nn.ConvTranspose(self.width, strides=(2, 2), **conv)
        self.to_pixels = nn.Conv(1, **conv)

    def encode(self, images):
        x = images
        for layer in self.encoder_convs:
            x = nn.gelu(layer(x))
        return self.to_latent(x.reshape(x.shape[0], -1))

    def decode(self, latent):
        x = nn.gelu(self.from_latent(latent)).reshape(latent.shape[0], 4, 4, 2 * self.width)
        x = nn.gelu(self.upsample(x))
        return nn.sigmoid(self.to_pixels(x))

    def __call__(self, images):
        return self.decode(self.encode(images))


def image_grid(originals, reconstructions, zoom: int = 4) -> np.ndarray:
    """Two rows (originals above reconstructions) of ``(N, H, W, 1)`` images in [0, 1], with a
    one-pixel white border around each, magnified ``zoom`` times: an ``(H', W')`` float image."""
    rows = []
    for images in (originals, reconstructions):
        framed = np.pad(np.asarray(images)[..., 0], ((0, 0), (1, 1), (1, 1)), constant_values=1.0)
        rows.append(np.concatenate(list(framed), axis=1))
    grid = np.concatenate(rows, axis=0)
    return np.kron(grid, np.ones((zoom, zoom), grid.dtype))


class AutoencoderTrainer(flaxlight.TrainerModule):
    """Reconstruction MSE; after each validation, a grid of reconstructions goes to TensorBoard."""

    def __init__(self, num_preview: int = 16, **kwargs: Any):
        self.num_preview = int(num_preview)
        super().__init__(**kwargs)
        self.config["num_preview"] = self.num_preview
        self._preview = None
        self._reconstruct = jax.jit(lambda state, images: state.apply_model(state.params, images, train=False)[0])

    def loss_fn(self, params, batch, *, train, rng, state):
        images = batch[0]
        reconstructions, updates = state.apply_model(params, images, train=train, rng=rng)
        return jnp.mean((reconstructions - images) ** 2), ({}, updates)

    def on_validation_epoch_end(self, epoch_idx: int, eval_metrics: dict, val_loader) -> None:
        if self._preview is None:  # the same validation digits every time: the first of the loader
            self._preview = np.asarray(next(iter(val_loader))[0][: self.num_preview])
        reconstructions = self._reconstruct(self.state, self._preview)
        self.log_image(IMAGE_TAG, image_grid(self._preview, reconstructions))


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--log-dir", default=None, help="default: checkpoints/ConvAutoencoder/version_N")
    parser.add_argument("--no-progress-bar", action="store_true")
    parser.add_argument("--no-summary", action="store_true", help="do not print the model table")
    parser.add_argument("--latent-dim", type=int, default=16)
    parser.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--check-val-every", type=int, default=1, help="validate (and log images) every N epochs")
    parser.add_argument("--train-fraction", type=float, default=1.0,
                        help="use only this fraction of the training images (fast tests)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    train_data, val_data, test_data = load_splits()
    if args.train_fraction < 1.0:
        keep = max(args.batch_size, int(len(train_data[0]) * args.train_fraction))
        train_data = (train_data[0][:keep], train_data[1][:keep])
    # The labels stay in the batches (unused by the loss): the loaders are the classifier's.
    train = flaxlight.ArrayLoader(*train_data, batch_size=args.batch_size, shuffle=True, seed=args.seed,
                                  drop_last=True)
    val = flaxlight.ArrayLoader(*val_data, batch_size=300)
    test = flaxlight.ArrayLoader(*test_data, batch_size=300)
    logger_params = {"log_dir": args.log_dir} if args.log_dir else {"base_log_dir": "checkpoints"}
    trainer = AutoencoderTrainer(
        model_class=ConvAutoencoder,
        model_hparams={"latent_dim": args.latent_dim, "width": args.width},
        optimizer_hparams={"optimizer": "adamw", "lr": args.lr, "weight_decay": 1e-4,
                           "warmup_steps": min(2, args.epochs // 10) * len(train)},
        exmp_input=train_data[0][:1],
        seed=args.seed,
        logger_params=logger_params,
        enable_progress_bar=not args.no_progress_bar,
        enable_model_summary=not args.no_summary,
        check_val_every_n_epoch=args.check_val_every,
        monitor="val/loss", mode="min",
    )
    metrics = trainer.train_model(train, val, test_loader=test, num_epochs=args.epochs)
    mean_image = train_data[0].mean(axis=0)
    metrics["test/mean_image_mse"] = float(np.mean((test_data[0] - mean_image) ** 2))
    print(f"test reconstruction MSE {metrics['test/loss']:.5f} per pixel (latent dim {args.latent_dim}; "
          f"predicting the mean training image: {metrics['test/mean_image_mse']:.5f})")
    print(f"logs, TensorBoard images ({IMAGE_TAG!r}) and checkpoint: {trainer.log_dir}")
    return metrics


if __name__ == "__main__":
    main()
