// Structured outputs' per-request grammar work without the GIL: llguidance's matchers through its
// C API, and a native thread that advances a step's grammars by their samples and fills the next
// step's token bitmask while the Python thread schedules and launches that step.
//
// Why native: llguidance's Python calls release the GIL while they compute, but a Python thread
// must take the GIL back after each one, and every such handoff stalls the thread that launches
// the steps (~20 us each, several a step). On a step bound by the host (a small model on a GPU)
// those handoffs cost about as much as the overlap gained. This thread never touches Python
// objects.
//
// The C API is llguidance's own (llguidance.h); its Python extension exports it, so the symbols
// are taken from that library, already loaded by the process: no second copy of llguidance.
//
// The ahead job: the step's samples land in a pinned host buffer (int64, one per sample row)
// that the Python side set to -1 before queueing the device-to-host copy. The thread waits until
// every sample it needs holds a token id (0 <= id < vocab: a value still being written never
// passes), then for each (matcher, sample row, mask row): a stop token ends the grammar if it is
// complete (or is refused); a text token is consumed if the grammar allows it (or is refused);
// a consumed grammar's next mask is written to its mask row. Statuses come back through wait();
// resubmit() runs the last job's matchers and rows again on a new step's samples.

#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() std::this_thread::yield()
#endif

namespace py = pybind11;

namespace {

struct LlgTokenizer;
struct LlgMatcher;

// llguidance.h's LlgTokenizerInitV2; the library reads struct_size bytes of it.
struct TokenizerInitV2 {
    size_t struct_size;
    uint32_t vocab_size;
    uint32_t tok_eos;
    const uint32_t* token_lens;
    const uint8_t* token_bytes;
    const char* tokenizer_json;
    bool tokenize_assumes_string;
    void* tokenize_fn;
    bool use_approximate_greedy_tokenize_fn;
    const void* tokenize_user_data;
    const char* const* slices;
    const uint32_t* tok_eos_extra;
    uint32_t tok_eos_extra_count;
};

// LlgConstraintInit starts with these fields; the rest (the parser limits) is left as
// llg_constraint_init_set_defaults writes it, into a buffer larger than any version's struct.
struct ConstraintInitHead {
    const LlgTokenizer* tokenizer;
    uint32_t log_buffer_level;
    uint32_t log_stderr_level;
};
constexpr size_t kConstraintInitBytes = 1024;

struct Api {
    LlgTokenizer* (*new_tokenizer_v2)(const TokenizerInitV2*, char*, size_t);
    void (*free_tokenizer)(LlgTokenizer*);
    void (*constraint_init_set_defaults)(void*, const LlgTokenizer*);
    LlgMatcher* (*new_matcher)(const void*, const char*, const char*);
    LlgMatcher* (*clone_matcher)(const LlgMatcher*);
    void (*free_matcher)(LlgMatcher*);
    const char* (*matcher_get_error)(LlgMatcher*);
    bool (*matcher_is_error)(const LlgMatcher*);
    int32_t (*matcher_consume_token)(LlgMatcher*, uint32_t);
    int32_t (*matcher_validate_tokens)(LlgMatcher*, const uint32_t*, size_t);
    int32_t (*matcher_compute_mask_into)(LlgMatcher*, uint32_t*, size_t);
    int32_t (*matcher_rollback)(LlgMatcher*, size_t);
    int32_t (*matcher_reset)(LlgMatcher*);
    bool (*matcher_is_accepting)(LlgMatcher*);
    bool (*matcher_is_stopped)(const LlgMatcher*);
};

Api api;
bool api_loaded = false;

template <typename F>
void resolve(void* library, const char* name, F& fn) {
    fn = reinterpret_cast<F>(dlsym(library, name));
    if (fn == nullptr) {
        throw std::runtime_error(std::string("llguidance's library does not export ") + name);
    }
}

void load_api(const std::string& library_path) {
    if (api_loaded) return;
    void* library = dlopen(library_path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
        throw std::runtime_error("cannot open llguidance's library " + library_path + ": " + dlerror());
    }
    resolve(library, "llg_new_tokenizer_v2", api.new_tokenizer_v2);
    resolve(library, "llg_free_tokenizer", api.free_tokenizer);
    resolve(library, "llg_constraint_init_set_defaults", api.constraint_init_set_defaults);
    resolve(library, "llg_new_matcher", api.new_matcher);
    resolve(library, "llg_clone_matcher", api.clone_matcher);
    resolve(library, "llg_free_matcher", api.free_matcher);
    resolve(library, "llg_matcher_get_error", api.matcher_get_error);
    resolve(library, "llg_matcher_is_error", api.matcher_is_error);
    resolve(library, "llg_matcher_consume_token", api.matcher_consume_token);
    resolve(library, "llg_matcher_validate_tokens", api.matcher_validate_tokens);
    resolve(library, "llg_matcher_compute_mask_into", api.matcher_compute_mask_into);
    resolve(library, "llg_matcher_rollback", api.matcher_rollback);
    resolve(library, "llg_matcher_reset", api.matcher_reset);
    resolve(library, "llg_matcher_is_accepting", api.matcher_is_accepting);
    resolve(library, "llg_matcher_is_stopped", api.matcher_is_stopped);
    api_loaded = true;
}

class Tokenizer {
   public:
    Tokenizer(const std::string& library_path, const std::string& tokenizer_json, uint32_t vocab_size,
              const std::vector<uint32_t>& eos_token_ids) {
        load_api(library_path);
        if (eos_token_ids.empty()) throw std::invalid_argument("eos_token_ids must not be empty");
        TokenizerInitV2 init;
        std::memset(&init, 0, sizeof(init));
        init.struct_size = sizeof(init);
        init.vocab_size = vocab_size;
        init.tok_eos = eos_token_ids[0];
        init.tokenizer_json = tokenizer_json.c_str();
        // Matchers only need the vocabulary's bytes; tokenizing text (fast-forward tokens) is
        // not used here.
        init.use_approximate_greedy_tokenize_fn = true;
        std::vector<uint32_t> extra(eos_token_ids.begin() + 1, eos_token_ids.end());
        init.tok_eos_extra = extra.empty() ? nullptr : extra.data();
        init.tok_eos_extra_count = static_cast<uint32_t>(extra.size());
        char error[1024] = {0};
        tokenizer_ = api.new_tokenizer_v2(&init, error, sizeof(error));
        if (tokenizer_ == nullptr) throw std::runtime_error(std::string("llguidance tokenizer: ") + error);
        mask_bytes_ = (static_cast<size_t>(vocab_size) + 31) / 32 * 4;
        eos_token_ids_ = eos_token_ids;
    }
    ~Tokenizer() { api.free_tokenizer(tokenizer_); }
    Tokenizer(const Tokenizer&) = delete;
    Tokenizer& operator=(const Tokenizer&) = delete;

    const LlgTokenizer* get() const { return tokenizer_; }
    size_t mask_bytes() const { return mask_bytes_; }

    // The mask of a grammar whose mask cannot be computed (a parser limit hit): only the stop
    // tokens, so the request ends rather than samples from nothing.
    void write_stop_mask(uint32_t* destination) const {
        std::memset(destination, 0, mask_bytes_);
        for (uint32_t token : eos_token_ids_) {
            if (token / 32 < mask_bytes_ / 4) destination[token / 32] |= 1u << (token % 32);
        }
    }

   private:
    LlgTokenizer* tokenizer_;
    size_t mask_bytes_;
    std::vector<uint32_t> eos_token_ids_;
};

// One grammar's matcher, with the method names of llguidance's Python LLMatcher that the
// Python side calls, so either can stand behind a request's grammar.
class Matcher {
   public:
    Matcher(LlgMatcher* matcher, std::shared_ptr<Tokenizer> tokenizer)
        : matcher_(matcher), tokenizer_(std::move(tokenizer)) {}
    ~Matcher() { api.free_matcher(matcher_); }
    Matcher(const Matcher&) = delete;
    Matcher& operator=(const Matcher&) = delete;

    static std::shared_ptr<Matcher> create(std::shared_ptr<Tokenizer> tokenizer, const std::string& grammar) {
        alignas(16) unsigned char init[kConstraintInitBytes] = {0};
        api.constraint_init_set_defaults(init, tokenizer->get());
        auto* head = reinterpret_cast<ConstraintInitHead*>(init);
        head->log_buffer_level = 0;
        head->log_stderr_level = 0;
        LlgMatcher* matcher = api.new_matcher(init, "llguidance", grammar.c_str());
        return std::make_shared<Matcher>(matcher, std::move(tokenizer));
    }

    std::shared_ptr<Matcher> deep_copy() const {
        return std::make_shared<Matcher>(api.clone_matcher(matcher_), tokenizer_);
    }
    size_t mask_bytes() const { return tokenizer_->mask_bytes(); }
    bool is_error() const { return api.matcher_is_error(matcher_); }
    std::string get_error() {
        const char* error = api.matcher_get_error(matcher_);
        return error == nullptr ? std::string() : std::string(error);
    }
    bool is_accepting() { return api.matcher_is_accepting(matcher_); }
    bool is_stopped() const { return api.matcher_is_stopped(matcher_); }
    bool reset() { return api.matcher_reset(matcher_) == 0; }
    bool rollback(size_t num_tokens) { return api.matcher_rollback(matcher_, num_tokens) == 0; }

    // How many of ``tokens`` the grammar allows in a row; those are consumed (the matcher stays
    // usable after a refusal, as LLMatcher.try_consume_tokens).
    int try_consume_tokens(const std::vector<uint32_t>& tokens) {
        if (tokens.empty() || is_error()) return 0;
        int32_t allowed = api.matcher_validate_tokens(matcher_, tokens.data(), tokens.size());
        int consumed = 0;
        for (int32_t i = 0; i < allowed; ++i, ++consumed) {
            if (api.matcher_consume_token(matcher_, tokens[i]) != 0) break;
        }
        return consumed;
    }
    bool consume_one(uint32_t token) {
        return !is_error() && api.matcher_validate_tokens(matcher_, &token, 1) == 1 &&
               api.matcher_consume_token(matcher_, token) == 0;
    }
    // The next mask into ``destination`` (mask_bytes); the stop tokens alone where llguidance
    // cannot compute it. False in that case.
    bool fill_mask(uint32_t* destination) {
        if (api.matcher_compute_mask_into(matcher_, destination, tokenizer_->mask_bytes()) == 0) return true;
        tokenizer_->write_stop_mask(destination);
        return false;
    }
    void unsafe_compute_mask_ptr(uintptr_t destination, size_t num_bytes) {
        if (num_bytes != tokenizer_->mask_bytes()) {
            throw std::invalid_argument("mask row of " + std::to_string(num_bytes) + " bytes, expected " +
                                        std::to_string(tokenizer_->mask_bytes()));
        }
        py::gil_scoped_release no_gil;
        fill_mask(reinterpret_cast<uint32_t*>(destination));
    }

   private:
    LlgMatcher* matcher_;
    std::shared_ptr<Tokenizer> tokenizer_;
};

// A row of the caller's buffer must hold exactly a matcher's mask: llguidance writes that many bytes.
void check_row_bytes(const std::vector<std::shared_ptr<Matcher>>& matchers, size_t row_bytes) {
    for (const auto& matcher : matchers) {
        if (matcher->mask_bytes() != row_bytes) {
            throw std::invalid_argument("mask rows of " + std::to_string(row_bytes) + " bytes, expected " +
                                        std::to_string(matcher->mask_bytes()));
        }
    }
}

// Fill several matchers' masks into rows of one buffer (rows * row_bytes bytes), without the GIL.
void fill_masks(const std::vector<std::shared_ptr<Matcher>>& matchers, const std::vector<int64_t>& rows,
                uintptr_t buffer, size_t row_bytes, size_t num_rows) {
    if (matchers.size() != rows.size()) throw std::invalid_argument("one row per matcher");
    check_row_bytes(matchers, row_bytes);
    for (int64_t row : rows) {
        if (row < 0 || static_cast<size_t>(row) >= num_rows) throw std::out_of_range("mask row out of range");
    }
    py::gil_scoped_release no_gil;
    for (size_t i = 0; i < matchers.size(); ++i) {
        auto* destination = reinterpret_cast<uint32_t*>(buffer + rows[i] * row_bytes);
        matchers[i]->fill_mask(destination);
    }
}

enum Status : int { kPending = -1, kConsumed = 0, kTerminated = 1, kRefused = 2, kTimedOut = 3 };

// The ahead thread: one job at a time, submitted after a step's sampler is launched, collected
// by the next step.
class AheadWorker {
   public:
    AheadWorker(std::vector<uint32_t> stop_token_ids, uint32_t vocab_size, double timeout_s)
        : stop_(stop_token_ids.begin(), stop_token_ids.end()), vocab_size_(vocab_size), timeout_s_(timeout_s) {
        thread_ = std::thread([this] { run(); });
    }
    ~AheadWorker() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            exiting_ = true;
            cancelled_ = true;
        }
        wake_.notify_all();
        thread_.join();
    }

    void submit(uintptr_t samples, size_t num_samples, std::vector<std::shared_ptr<Matcher>> matchers,
                std::vector<int64_t> sample_rows, std::vector<int64_t> mask_rows, uintptr_t masks,
                size_t row_bytes, size_t num_mask_rows) {
        if (matchers.size() != sample_rows.size() || matchers.size() != mask_rows.size()) {
            throw std::invalid_argument("one sample row and one mask row per matcher");
        }
        check_row_bytes(matchers, row_bytes);
        std::unique_lock<std::mutex> lock(mutex_);
        if (has_job_) throw std::logic_error("the previous job was not collected");
        check_rows(sample_rows, mask_rows, num_samples, num_mask_rows);
        job_ = Job{reinterpret_cast<const int64_t*>(samples), std::move(matchers), std::move(sample_rows),
                   std::move(mask_rows), masks, row_bytes};
        start(lock);
    }

    // The last job's matchers and rows again, for this step's samples and mask buffer: the
    // steady state of decoding, where the batch did not change.
    void resubmit(uintptr_t samples, size_t num_samples, uintptr_t masks, size_t num_mask_rows) {
        std::unique_lock<std::mutex> lock(mutex_);
        if (has_job_) throw std::logic_error("the previous job was not collected");
        if (job_.matchers.empty()) throw std::logic_error("no job to submit again");
        check_rows(job_.sample_rows, job_.mask_rows, num_samples, num_mask_rows);
        job_.samples = reinterpret_cast<const int64_t*>(samples);
        job_.masks = masks;
        start(lock);
    }

    // (statuses, tokens) of the job, waiting for it without the GIL; empty lists without a job.
    std::pair<std::vector<int>, std::vector<int64_t>> wait() {
        py::gil_scoped_release no_gil;
        std::unique_lock<std::mutex> lock(mutex_);
        if (!has_job_) return {};
        finished_.wait(lock, [this] { return done_; });
        has_job_ = false;  // the job's matchers stay referenced, for resubmit
        return {std::move(statuses_), std::move(tokens_)};
    }

    // Give up waiting for the samples (a step that failed): the job ends with kTimedOut.
    void cancel() {
        cancelled_ = true;
    }

   private:
    struct Job {
        const int64_t* samples = nullptr;
        std::vector<std::shared_ptr<Matcher>> matchers;
        std::vector<int64_t> sample_rows;
        std::vector<int64_t> mask_rows;
        uintptr_t masks = 0;
        size_t row_bytes = 0;
    };

    static void check_rows(const std::vector<int64_t>& sample_rows, const std::vector<int64_t>& mask_rows,
                           size_t num_samples, size_t num_mask_rows) {
        for (size_t i = 0; i < sample_rows.size(); ++i) {
            if (sample_rows[i] < 0 || static_cast<size_t>(sample_rows[i]) >= num_samples)
                throw std::out_of_range("sample row out of range");
            if (mask_rows[i] < 0 || static_cast<size_t>(mask_rows[i]) >= num_mask_rows)
                throw std::out_of_range("mask row out of range");
        }
    }

    // Called with the lock held: the job is set.
    void start(std::unique_lock<std::mutex>& lock) {
        statuses_.assign(job_.matchers.size(), kPending);
        tokens_.assign(job_.matchers.size(), -1);
        has_job_ = true;
        done_ = false;
        cancelled_ = false;
        lock.unlock();
        wake_.notify_all();
    }

    int64_t load_sample(int64_t row) const {
        return __atomic_load_n(job_.samples + row, __ATOMIC_ACQUIRE);
    }

    bool wait_for_samples() {
        const auto start = std::chrono::steady_clock::now();
        for (int spin = 0;; ++spin) {
            bool ready = true;
            for (int64_t row : job_.sample_rows) {
                const int64_t token = load_sample(row);
                if (token < 0 || token >= static_cast<int64_t>(vocab_size_)) {
                    ready = false;
                    break;
                }
            }
            if (ready) return true;
            if (cancelled_.load(std::memory_order_relaxed)) return false;
            // Spin for the usual wait (the sampler and one copy, tens of microseconds), then sleep
            // in short slices.
            if (spin < 2000) {
                CPU_RELAX();
            } else {
                std::this_thread::sleep_for(std::chrono::microseconds(20));
                if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s_)
                    return false;
            }
        }
    }

    void run_job() {
        if (!wait_for_samples()) {
            std::fill(statuses_.begin(), statuses_.end(), static_cast<int>(kTimedOut));
            return;
        }
        for (size_t i = 0; i < job_.matchers.size(); ++i) {
            const int64_t token = load_sample(job_.sample_rows[i]);
            tokens_[i] = token;
            Matcher& matcher = *job_.matchers[i];
            if (stop_.count(static_cast<uint32_t>(token))) {
                statuses_[i] = matcher.is_accepting() ? kTerminated : kRefused;
                continue;
            }
            if (!matcher.consume_one(static_cast<uint32_t>(token))) {
                statuses_[i] = kRefused;
                continue;
            }
            auto* destination = reinterpret_cast<uint32_t*>(job_.masks + job_.mask_rows[i] * job_.row_bytes);
            matcher.fill_mask(destination);
            statuses_[i] = kConsumed;
        }
    }

    void run() {
        std::unique_lock<std::mutex> lock(mutex_);
        while (true) {
            wake_.wait(lock, [this] { return exiting_ || (has_job_ && !done_); });
            if (exiting_) return;
            lock.unlock();
            run_job();
            lock.lock();
            done_ = true;
            finished_.notify_all();
        }
    }

    const std::unordered_set<uint32_t> stop_;
    const uint32_t vocab_size_;
    const double timeout_s_;
    std::mutex mutex_;
    std::condition_variable wake_;
    std::condition_variable finished_;
    bool exiting_ = false;
    bool has_job_ = false;
    bool done_ = false;
    std::atomic<bool> cancelled_{false};
    Job job_;
    std::vector<int> statuses_;
    std::vector<int64_t> tokens_;
    std::thread thread_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "llguidance matchers and the structured-output ahead thread, without the GIL";
    py::class_<Tokenizer, std::shared_ptr<Tokenizer>>(m, "Tokenizer")
        .def(py::init<const std::string&, const std::string&, uint32_t, const std::vector<uint32_t>&>(),
             py::arg("library_path"), py::arg("tokenizer_json"), py::arg("vocab_size"), py::arg("eos_token_ids"))
        .def_property_readonly("mask_bytes", &Tokenizer::mask_bytes);
    py::class_<Matcher, std::shared_ptr<Matcher>>(m, "Matcher")
        .def_static("create", &Matcher::create, py::arg("tokenizer"), py::arg("grammar"))
        .def("deep_copy", &Matcher::deep_copy)
        .def("is_error", &Matcher::is_error)
        .def("get_error", &Matcher::get_error)
        .def("is_accepting", &Matcher::is_accepting)
        .def("is_stopped", &Matcher::is_stopped)
        .def("reset", &Matcher::reset)
        .def("rollback", &Matcher::rollback)
        .def("try_consume_tokens", &Matcher::try_consume_tokens)
        .def("unsafe_compute_mask_ptr", &Matcher::unsafe_compute_mask_ptr);
    m.def("fill_masks", &fill_masks, py::arg("matchers"), py::arg("rows"), py::arg("buffer"), py::arg("row_bytes"),
          py::arg("num_rows"));
    py::class_<AheadWorker>(m, "AheadWorker")
        .def(py::init<std::vector<uint32_t>, uint32_t, double>(), py::arg("stop_token_ids"), py::arg("vocab_size"),
             py::arg("timeout_s"))
        .def("submit", &AheadWorker::submit)
        .def("resubmit", &AheadWorker::resubmit)
        .def("wait", &AheadWorker::wait)
        .def("cancel", &AheadWorker::cancel);
    m.attr("CONSUMED") = static_cast<int>(kConsumed);
    m.attr("TERMINATED") = static_cast<int>(kTerminated);
    m.attr("REFUSED") = static_cast<int>(kRefused);
    m.attr("TIMED_OUT") = static_cast<int>(kTimedOut);
}
