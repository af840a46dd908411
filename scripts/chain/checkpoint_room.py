"""Where a train session's checkpoints live and what publishing them takes: whether they fit the session's 20 GB
output (else one is kept in /kaggle/temp, and the session's own publish is the only copy), how many a publish
uploads, and how long that takes at the assumed rate. Loading places the checkpoints and sizes the publish margin
from these (scripts/chain/config.py); the storage plan, the train stage and --plan read them too. Functions of the
typed train settings (shared/config.py TrainConfig) and a checkpoint's bytes, so the chain's config sits above."""

from __future__ import annotations

from scripts.chain.limits import ASSUMED_UPLOAD_BYTES_PER_S, OUTPUT_LIMIT_BYTES
from shared.config import TrainConfig
from shared.errors import UserError
from shared.kaggle.publish import TEMP_PUBLISH_VERIFY_S


def checkpoints_in_temp(train: TrainConfig) -> bool:
    """Whether the train sessions keep their checkpoints in /kaggle/temp (gone with the session, not in its
    output): the session's own publish is then the only copy."""
    return train.session.checkpoint_dir.startswith("{temp}")


def publish_verify_s(train: TrainConfig) -> float:
    """How long a train session waits for its own new checkpoint version, publishing again if that failed
    (shared.kaggle.publish `verify_publish`): only for checkpoints in /kaggle/temp, which the chain cannot publish
    from the output, so a failed version after a deleting publish would leave none anywhere."""
    return TEMP_PUBLISH_VERIFY_S if checkpoints_in_temp(train) else 0.0


def keeps_stable(train: TrainConfig) -> bool:
    """Whether the run keeps (and the checkpoint dataset carries) the checkpoint where a wsd schedule's stable
    phase ends (train.keep_stable, for --extend)."""
    return train.lr_schedule.schedule == "wsd" and train.session.keep_stable


def checkpoint_uploads(train: TrainConfig) -> int:
    """Checkpoints a session's publish uploads: the newest, and for a wsd run the stable-phase one beside it."""
    return 2 if keeps_stable(train) else 1


# A publish uploads its checkpoint once, a deleting one too: its create deletes the older versions of the checkpoint
# dataset it publishes to, while the other holds the newest proven one (scripts/chain/checkpoints.py `publish_target`).
PUBLISH_UPLOADS = 1


def publish_needs_s(train: TrainConfig, size: int) -> float:
    """The least a session's publish can take: its checkpoint's upload at the assumed rate, and for checkpoints in
    /kaggle/temp the session's wait for its version."""
    return upload_s(train, size) + publish_verify_s(train)


def upload_s(train: TrainConfig, size: int) -> float:
    """A session's publish uploads at the assumed rate: its checkpoints (the newest, the stable-phase one), once."""
    return PUBLISH_UPLOADS * checkpoint_uploads(train) * size / ASSUMED_UPLOAD_BYTES_PER_S


def publish_words(train: TrainConfig, size: int) -> str:
    """What `publish_needs_s` counts, in words (an error's)."""
    uploads = PUBLISH_UPLOADS * checkpoint_uploads(train)
    words = f"{uploads} x " + (f"{size / 1e9:.2g} GB at an assumed {ASSUMED_UPLOAD_BYTES_PER_S / 1e6:g} MB/s "
                               "(uploaded once, a deleting publish too)")
    if publish_verify_s(train):
        words += f" + the session's {publish_verify_s(train):.0f}-s wait for its version"
    return words


# Checkpoints must fit the session's 20 GB output, with one more being written before the oldest goes: models too
# large for that keep one checkpoint in /kaggle/temp (the session publishes it from there); a setting that would
# overflow the output is an error at load, not a full disk hours into a session. The publish margin grows with the
# upload (the stable-phase checkpoint travels beside the newest), and where checkpoints live in /kaggle/temp with
# the session's wait for its version (TEMP_PUBLISH_VERIFY_S).

def _output_peak(train: TrainConfig, size: int) -> int:
    """What the checkpoints hold in the output at most: those kept, the one being written, the stable-phase one."""
    return (train.session.keep_checkpoints + 1 + int(keeps_stable(train))) * size


def check_checkpoint_room(train: TrainConfig, given: dict, size: int, where: str) -> None:
    """The checkpoints of `train` (whose settings as the config gives them are `given`), each of `size` bytes, can
    be placed: in /kaggle/temp, or in /kaggle/working where they fit the output or the config left their placing
    to the chain (`placed_settings`)."""
    if checkpoints_in_temp(train):
        return
    if (checkpoint_dir := train.session.checkpoint_dir) and not checkpoint_dir.startswith("{working}"):
        raise UserError(f"{where}: train.checkpoint_dir {checkpoint_dir!r} must be under {{working}} or {{temp}}")
    peak = _output_peak(train, size)
    if peak > OUTPUT_LIMIT_BYTES and ("checkpoint_dir" in given or "keep_checkpoints" in given):
        keep, stable = train.session.keep_checkpoints, keeps_stable(train)
        also = " and the stable-phase one" if stable else ""
        raise UserError(f"{where}: {keep} kept checkpoints of {size / 1e9:.1f} GB ({keep + 1} while one is written"
                        f"{also}, {peak / 1e9:.1f} GB) overflow the session's {OUTPUT_LIMIT_BYTES / 1e9:g} GB output; "
                        "set train.checkpoint_dir to \"{temp}/checkpoints\" and train.keep_checkpoints to 1")


def placed_settings(given: dict, train: TrainConfig, size: int) -> dict:
    """The train settings as given (`given`, typed: `train`) with their checkpoints of `size` bytes placed (checked
    by `check_checkpoint_room`): where they overflow the output, one kept in /kaggle/temp; in /kaggle/temp no
    stable-phase one (it would go with the session)."""
    if checkpoints_in_temp(train):
        return {**given, "keep_stable": False}
    if _output_peak(train, size) <= OUTPUT_LIMIT_BYTES:
        return given
    return {**given, "checkpoint_dir": "{temp}/checkpoints", "keep_checkpoints": 1, "keep_stable": False}
