"""Which record fills which row: keyed orders, interleaves, phases and mixtures, as pure integer
functions of (configuration, seed, step); no files, no jax."""
