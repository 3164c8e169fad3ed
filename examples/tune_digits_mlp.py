"""The seed's Optuna study, on scikit-learn's digits: tune dropout, weight decay and learning rate.

The MLP and trainer of ``digits_mlp.py`` (from ``flaxlight.zoo``) (BatchNorm, dropout, AdamW). Search space, as in the
seed: dropout in [0, 0.6], weight decay log-uniform in [1e-6, 1e-2], learning rate log-uniform in
[1e-4, 1e-2]; TPE sampler, median pruner, validation accuracy maximised. The study lives in
``<base-dir>/<study-name>/study.db``: run the script again to add trials to it, or start several
copies at once to share the work. At the end the best trial's model is reloaded from its
checkpoint and tested, and the parameter importances are printed.

Run: python examples/tune_digits_mlp.py [--n-trials 20] [--epochs 15] [--plot-dir DIR]
The same study from a config: flaxlight tune --config examples/configs/tune_digits_mlp.yaml
"""

from __future__ import annotations

import argparse
from typing import Sequence

import optuna

import flaxlight
from flaxlight.tune import Float, load_best, param_importances, plot_study, tune
from flaxlight.zoo import ClassificationTrainer, MLPClassifier, digits_splits

SEARCH_SPACE = {
    "model_hparams.dropout_prob": Float(0.0, 0.6),
    "optimizer_hparams.weight_decay": Float(1e-6, 1e-2, log=True),
    "optimizer_hparams.lr": Float(1e-4, 1e-2, log=True),
}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-trials", type=int, default=20, help="trials to run now (added to the stored study)")
    parser.add_argument("--epochs", type=int, default=15, help="epochs per trial")
    parser.add_argument("--base-dir", default="studies", help="studies live in BASE_DIR/STUDY_NAME")
    parser.add_argument("--study-name", default="digits_mlp")
    parser.add_argument("--storage", default=None, help="database URL (default: SQLite in the study's dir)")
    parser.add_argument("--seed", type=int, default=None, help="TPE sampler seed")
    parser.add_argument("--hidden-dims", type=int, nargs="+", default=[256, 256], help="the MLP's layer sizes")
    parser.add_argument("--plot-dir", default=None, help="also write the study's plots (PNG) here")
    args = parser.parse_args(argv)

    train_data, val_data, test_data = digits_splits(seed=0)  # 1197 / 300 / 300
    # Batches of one shape only: each trial is a new model, compiled anew, once per batch shape
    # (drop_last: the 45 examples left over in an epoch are others in the next one; val and test
    # are one batch of 300 each).
    train = flaxlight.ArrayLoader(*train_data, batch_size=64, shuffle=True, seed=0, drop_last=True)
    val = flaxlight.ArrayLoader(*val_data, batch_size=len(val_data[1]))
    test = flaxlight.ArrayLoader(*test_data, batch_size=len(test_data[1]))
    exmp_input = train_data[0][:1]

    study = tune(
        ClassificationTrainer,
        SEARCH_SPACE,
        hparams=dict(
            model_class=MLPClassifier,
            model_hparams={"hidden_dims": args.hidden_dims, "num_classes": 10},
            # the seed's warmup of 20 updates (shorter when a fast run has fewer updates than that)
            optimizer_hparams={"optimizer": "adamw", "lr": 1e-3, "weight_decay": 1e-4,
                               "warmup": min(20, len(train) * args.epochs // 2)},
            exmp_input=exmp_input,
        ),
        train_loader=train,
        val_loader=val,
        num_epochs=args.epochs,
        metric="val/acc",
        direction="maximize",
        n_trials=args.n_trials,
        storage=args.storage,
        study_name=args.study_name,
        base_dir=args.base_dir,
        seed=args.seed,
    )

    states = [t.state for t in study.trials]
    count = {s.name.lower(): states.count(s) for s in optuna.trial.TrialState if states.count(s)}
    print(f"\nstudy {study.study_name!r}: {len(states)} trials {count}")
    if not count.get("complete"):
        errors = {t.user_attrs.get("error") for t in study.trials if t.state == optuna.trial.TrialState.FAIL}
        raise SystemExit(f"No trial completed; errors: {sorted(e for e in errors if e)}")
    best = study.best_trial
    print(f"best trial: #{best.number}  val/acc {best.value:.4f}  (epochs {best.user_attrs.get('epochs')})")
    for key, value in best.params.items():
        print(f"  {key:32s} {value:.3g}")
    print(f"  log dir: {best.user_attrs['log_dir']}")

    trainer = load_best(study, ClassificationTrainer, exmp_input=exmp_input)
    val_acc = trainer.eval_model(val, log_prefix="val/")["val/acc"]  # the same model the study scored
    test_metrics = trainer.eval_model(test, log_prefix="test/")
    print(f"test accuracy of the reloaded best model: {test_metrics['test/acc']:.4f} (its val/acc {val_acc:.4f})")

    importances = {}
    if count.get("complete", 0) >= 2:
        importances = param_importances(study)
        print("parameter importances:" if importances else "parameter importances: none (the completed trials "
              "do not tell the parameters apart; run more trials)")
        for key, value in importances.items():
            print(f"  {key:32s} {value:.3f}")
    plots = plot_study(study, out_dir=args.plot_dir) if args.plot_dir else []
    for path in plots:
        print(f"plot: {path}")
    return {"study": study, "best_value": best.value, "best_params": dict(best.params),
            "test/acc": test_metrics["test/acc"], "reloaded_val/acc": val_acc, "importances": importances, "plots": plots}


if __name__ == "__main__":
    main()
