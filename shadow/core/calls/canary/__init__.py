"""The canary A/B that has no shadow run: the DataLoader iterator's arms."""
