// A pipelined strategy with a bf16 precision entry: the pipeline's stages
// compute in fp32 only, so the stage type refuses the entry instead of
// ignoring it.
#include <weft/parallel/pipeline/stage.hpp>

using S = weft::Strategy<weft::On<weft::PP, weft::Pipeline<weft::OneFOneB>>, weft::Precision<weft::BF16>>;
std::size_t n = sizeof(weft::pipeline::Stage<float, S>);
