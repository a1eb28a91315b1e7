"""The fleet package: archives, bundles, the registry and distribution."""
