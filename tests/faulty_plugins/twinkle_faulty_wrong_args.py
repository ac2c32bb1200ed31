"""Its ``twinkle_register_losses`` asks for an argument (``config``) that the hook specification lacks."""

from twinkle_core import LossRecord, hookimpl


@hookimpl
def twinkle_register_losses(config):
    yield LossRecord("wrong_args_loss", "twinkle_core.loss.mse:MSELoss")
