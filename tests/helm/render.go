// render renders a Helm chart's templates the way `helm template` does, with Go's own
// text/template and the few Sprig/Helm functions the crd-broker chart uses, so the chart can be
// checked where no helm binary can be installed. Only the standard library is used.
//
// Usage: go run render.go CHART_DIR CONTEXT.json
//
// CONTEXT.json holds {"Values": …, "Release": {"Name", "Namespace", "Service"},
// "Chart": {"Name", "Version", "AppVersion"}}; the caller merges values.yaml with overrides.
// A reference to a value that does not exist is an error (missingkey=error).
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"text/template"
)

func emit(b *strings.Builder, v interface{}, indent int) {
	pad := strings.Repeat(" ", indent)
	switch t := v.(type) {
	case map[string]interface{}:
		keys := make([]string, 0, len(t))
		for k := range t {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			child := t[k]
			switch c := child.(type) {
			case map[string]interface{}:
				if len(c) == 0 {
					fmt.Fprintf(b, "%s%s: {}\n", pad, k)
				} else {
					fmt.Fprintf(b, "%s%s:\n", pad, k)
					emit(b, c, indent+2)
				}
			case []interface{}:
				if len(c) == 0 {
					fmt.Fprintf(b, "%s%s: []\n", pad, k)
				} else {
					fmt.Fprintf(b, "%s%s:\n", pad, k)
					emit(b, c, indent)
				}
			default:
				fmt.Fprintf(b, "%s%s: %s\n", pad, k, scalar(c))
			}
		}
	case []interface{}:
		for _, item := range t {
			switch c := item.(type) {
			case map[string]interface{}, []interface{}:
				var inner strings.Builder
				emit(&inner, c, indent+2)
				text := inner.String()
				// The first line goes after the dash.
				fmt.Fprintf(b, "%s- %s", pad, strings.TrimPrefix(text, pad+"  "))
			default:
				fmt.Fprintf(b, "%s- %s\n", pad, scalar(c))
			}
		}
	default:
		fmt.Fprintf(b, "%s%s\n", pad, scalar(t))
	}
}

func scalar(v interface{}) string {
	switch t := v.(type) {
	case nil:
		return "null"
	case bool:
		return strconv.FormatBool(t)
	case float64:
		if t == float64(int64(t)) {
			return strconv.FormatInt(int64(t), 10)
		}
		return strconv.FormatFloat(t, 'f', -1, 64)
	case string:
		return strconv.Quote(t)
	default:
		return strconv.Quote(fmt.Sprint(t))
	}
}

func toYaml(v interface{}) string {
	var b strings.Builder
	emit(&b, v, 0)
	return strings.TrimSuffix(b.String(), "\n")
}

func indent(n int, s string) string {
	pad := strings.Repeat(" ", n)
	return pad + strings.ReplaceAll(s, "\n", "\n"+pad)
}

func empty(v interface{}) bool {
	if v == nil {
		return true
	}
	r := reflect.ValueOf(v)
	switch r.Kind() {
	case reflect.String, reflect.Map, reflect.Slice, reflect.Array:
		return r.Len() == 0
	case reflect.Bool:
		return !r.Bool()
	case reflect.Float64:
		return r.Float() == 0
	case reflect.Int, reflect.Int64:
		return r.Int() == 0
	}
	return false
}

func toInt(v interface{}) int {
	switch t := v.(type) {
	case float64:
		return int(t)
	case int:
		return t
	case string:
		n, _ := strconv.Atoi(t)
		return n
	}
	return 0
}

// Files is the chart's `.Files`: Get reads a file under the chart's directory (an error for a
// missing one, where helm would give "", so a wrong path cannot render silently).
type Files struct{ dir string }

func (f Files) Get(name string) (string, error) {
	text, err := os.ReadFile(filepath.Join(f.dir, name))
	return string(text), err
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: render CHART_DIR CONTEXT.json")
		os.Exit(2)
	}
	chart, contextPath := os.Args[1], os.Args[2]
	raw, err := os.ReadFile(contextPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var ctx map[string]interface{}
	if err := json.Unmarshal(raw, &ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ctx["Files"] = Files{dir: chart}
	root := template.New("chart").Option("missingkey=error")
	funcs := template.FuncMap{
		"toYaml":     toYaml,
		"nindent":    func(n int, s string) string { return "\n" + indent(n, s) },
		"indent":     indent,
		"quote":      func(v interface{}) string { return strconv.Quote(fmt.Sprint(v)) },
		"default":    func(d, v interface{}) interface{} { if empty(v) { return d }; return v },
		"required":   func(msg string, v interface{}) (interface{}, error) { if empty(v) { return nil, errors.New(msg) }; return v, nil },
		"fail":       func(msg string) (string, error) { return "", errors.New(msg) },
		"trunc":      func(n int, s string) string { if len(s) > n { return s[:n] }; return s },
		"trimSuffix": func(suffix, s string) string { return strings.TrimSuffix(s, suffix) },
		"contains":   func(sub, s string) bool { return strings.Contains(s, sub) },
		"int":        toInt,
		"add":        func(a, b int) int { return a + b },
		"include": func(name string, data interface{}) (string, error) {
			var out bytes.Buffer
			err := root.ExecuteTemplate(&out, name, data)
			return out.String(), err
		},
	}
	root.Funcs(funcs)
	files, _ := filepath.Glob(filepath.Join(chart, "templates", "*"))
	sort.Strings(files)
	for _, f := range files {
		text, err := os.ReadFile(f)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		if _, err := root.New(filepath.Base(f)).Parse(string(text)); err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", f, err)
			os.Exit(1)
		}
	}
	for _, f := range files {
		name := filepath.Base(f)
		if strings.HasPrefix(name, "_") {
			continue
		}
		var out bytes.Buffer
		if err := root.ExecuteTemplate(&out, name, ctx); err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
			os.Exit(1)
		}
		if name == "NOTES.txt" || strings.TrimSpace(out.String()) == "" {
			continue
		}
		fmt.Printf("---\n# Source: %s/templates/%s\n%s\n", filepath.Base(chart), name, strings.TrimSpace(out.String()))
	}
}
