"""The only floor that talks to transformers' attention and mask interfaces: the "hfkv" attention function
and enable()."""
