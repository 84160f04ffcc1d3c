"""The one typed configuration (distributed_config.DistributedConfig) and its sections, value types, presets and the
layout rules a config must obey before anything is generated."""
