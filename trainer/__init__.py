"""ddpkit's DDP trainer: the one entry point every target ends in (never imports `deploy`)."""
