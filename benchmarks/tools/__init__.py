"""The tools room: the deviceless H100/H200 compile, block-size search, kernel statistics, the GPU session script,
the default-order advice and the README's train example."""
