// Every bad attribute of a struct is reported in one compile.
use amp::AmpModule;

#[derive(AmpModule)]
#[amp(default = bf61)]
struct Block {
    #[amp(fp61)]
    a: amp::nn::Linear,
    #[amp(fp16, fp32)]
    b: amp::nn::Linear,
    #[amp(skip, bf16)]
    c: f32,
    #[amp(precision = fp16)]
    d: amp::nn::Linear,
}

fn train<M: AmpModule>(_model: &M) {}

fn main() {
    let block: Option<Block> = None;
    if let Some(block) = &block {
        train(block);
    }
}
