"""The tiny model every end-to-end test trains: 8x8 digits, an 8-channel two-level UNet,
100 timesteps. Tests add their own run-length and logging overrides after it."""

TINY_MODEL = [
    "data.image_size=8", "model.num_classes=10",
    "model.unet.channels=8", "model.unet.channel_mult=[1,2]", "model.unet.num_res_blocks=1",
    "model.unet.attention_resolutions=[4]", "model.unet.head_channels=8",
    "model.unet.norm_groups=4", "diffusion.timesteps=100", "train.batch_size=8",
    "train.sample_every=0", "logging.progress=false",
]
