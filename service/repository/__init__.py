"""The model repository contract, owned by the serving side: the manifest, the graphs' input
and output names, and how weights are stored and read. Torch-free; `export/` writes what this
package reads."""
