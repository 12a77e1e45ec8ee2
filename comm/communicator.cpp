// communicator.cpp: backend factory helpers shared by all communicators.
#include "comm/communicator.h"
