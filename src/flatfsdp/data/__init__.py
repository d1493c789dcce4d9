"""Text shipped with flatfsdp for the training command (original prose, same license as the package)."""
