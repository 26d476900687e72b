"""What scorers read, recorded: the observed prefill, a layer's fixed facts, observations of a held cache."""
