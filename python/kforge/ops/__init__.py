"""One module per op: `kforge.ops.<op>` holds the op's Thunder operators and its `SPEC` row
(see kforge._thunder). Modules are discovered, not listed: adding an op is adding its files."""
