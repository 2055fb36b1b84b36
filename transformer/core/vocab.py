"""Reserved token ids shared by every data source, the model and the decoders."""

PAD_ID = 0  # padding; segment id 0
BOS_ID = 1  # first decoder input of every target segment
EOS_ID = 2  # ends every source and target sequence
NUM_RESERVED = 3
RESERVED_PIECES = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>"}  # how pictures label them
