// A pipelined strategy with fp16 products: they need loss scaling, which the
// pipeline's train_step does not do, so the stage type refuses the entry
// instead of training without it (bf16 products compile: test_pipeline).
#include <weft/parallel/pipeline/stage.hpp>

using S = weft::Strategy<weft::On<weft::PP, weft::Pipeline<weft::OneFOneB>>,
                         weft::Precision<weft::FP16, weft::F32, weft::DynamicLossScale>>;
std::size_t n = sizeof(weft::pipeline::Stage<float, S>);
