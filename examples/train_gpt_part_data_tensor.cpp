// One part of train_gpt's strategy table (train_gpt_strategies.hpp, Part; run_part in train_gpt_impl.hpp):
// compiled in a translation unit of its own so that the parts build in parallel.
#include "train_gpt_impl.hpp"

template int train_gpt::run_part<train_gpt::Part::data_tensor>(const train_gpt::RunArgs&);
